"""The sizes the engines communicate in, which the estimator predicts from: kept here, free of torch, so that
`stratpack plan` answers without importing it."""

DEFAULT_BUCKET_CAP_MB = 25.0  # dp's buckets (and ZeRO-1/2's flats, which follow them): torch DDP's default
FIRST_BUCKET_BYTES = 2**20  # dp's first bucket: torch DDP's dist._DEFAULT_FIRST_BUCKET_BYTES
IN_FLIGHT = 2  # ZeRO-2/3: reduce-scatters in flight during backward, each holding its flat's full gradient
PIECES = 4  # async TP: the least pieces a collective is cut into; each piece's buffers are 1/k of the layer's


def pieces(local: int, tp: int) -> int:
    """How many pieces async TP cuts a rank's ``local`` rows of the sequence into (`tensor_parallel.overlap`): tp
    (a ring's steps, as torchtitan's) and at least `PIECES`, or the most below that which divide them."""
    return next(k for k in range(min(max(tp, PIECES), local), 0, -1) if local % k == 0)
