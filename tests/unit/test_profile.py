"""The device's split of a traced step (`measure.profile.device_split`), read off a trace in Chrome's format."""

from __future__ import annotations

import pytest

from strategies.measure.profile import device_split, kind_of


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_is_the_union_of_device_intervals_and_the_rest_of_the_wall_is_idle():
    trace = {"traceEvents": [
        _event("kernel", "nvjet_tst_128x256_64x4_gemm", 0, 400),        # matmul 0..400 us
        _event("kernel", "flash_fwd_kernel", 300, 200),                  # attention, overlapping: busy to 500
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 900, 100),  # a copy after a 400 us gap
        _event("kernel", "multi_tensor_apply_kernel<AdamW>", 1000, 500),
        _event("cpu_op", "aten::mm", 0, 5000),                           # the host's: not the device's
    ]}
    split = device_split(trace, steps=2, wall_s=0.004)  # 2 ms per step
    assert split["busy_s"] == pytest.approx(0.0011 / 2)
    assert split["idle_s"] == pytest.approx(0.002 - 0.00055)
    assert split["kinds"] == pytest.approx({"matmul": 0.0002, "attention": 0.0001, "copy": 0.00005,
                                            "optimizer": 0.00025})
    assert split["events"] == 4 and split["top_kernels"][0]["kind"] == "optimizer"


@pytest.mark.parametrize("name,kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"), ("cutlass_80_tensorop_s16816gemm", "matmul"),
    ("pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel", "attention"), ("fmha_cutlassF_bf16_aligned", "attention"),
    ("void at::native::fused_adamw_kernel", "optimizer"), ("ncclDevKernel_AllReduce", "collective"),
    ("triton_per_fused_add_native_layer_norm_0", "compiled"), ("vectorized_elementwise_kernel<4, gelu>", "other"),
])
def test_kernels_are_told_apart_by_name(name, kind):
    assert kind_of(name) == kind
