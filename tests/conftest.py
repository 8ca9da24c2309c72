"""Every test runs with strict p2p (`comm.p2p`, ``STRATPACK_STRICT_P2P``): gloo is made to follow NCCL's rules
(a rank's messages in issue order, each receive checked against the message it gets), so a change to the
pipeline's or any other p2p order that would hang or swap tensors on GPUs fails here. The ranks tests start
inherit it from this process's environment."""

import os

os.environ.setdefault("STRATPACK_STRICT_P2P", "60")
