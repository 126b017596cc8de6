"""Tier a: the collectives row holds NVLink bandwidth to half of the GPU's nominal figure (within
one node), and reports the numbers alone between nodes or for an unknown GPU."""

from stapo_megatron.doctor import collectives


def test_collectives_row_holds_nvlink_to_its_nominal_figure():
    assert collectives.nominal_gbps("NVIDIA H100 80GB HBM3") == 450 and collectives.nominal_gbps("NVIDIA GB200") == 900
    assert collectives.nominal_gbps("NVIDIA L40S") is None
    fast = dict(ranks=8, all_reduce_busbw_gbps=380.0, all_gather_busbw_gbps=350.0)
    assert collectives.row(fast, "nccl", "NVIDIA H100 80GB HBM3").status == "pass"
    slow = collectives.row(dict(fast, all_gather_busbw_gbps=40.0), "nccl", "NVIDIA H100 80GB HBM3")
    assert slow.status == "fail" and "under 50% of NVIDIA H100 80GB HBM3's nominal 450 GB/s" in slow.detail
    # between nodes, or an unknown GPU: the numbers, no bound
    assert collectives.row(dict(slow.values, multi_node=True), "nccl", "NVIDIA H100 80GB HBM3").status == "pass"
