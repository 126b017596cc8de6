"""Tier a: the version combinations stapo-doctor names as known to fail (vLLM's torch pin, torch's
triton pin, the tested megatron-core range, the driver's CUDA)."""

from stapo_megatron.doctor import versions


def test_known_bad_version_combinations_are_named():
    good = dict(torch="2.14.0+cu130", vllm="0.33.0", triton="3.6.0", **{"megatron-core": "0.19.2"})
    assert versions.known_problems(good, "13.0", "13.0", "2.14.0", "3.6.0") == []
    # an NGC image whose constraint file kept its own torch under vLLM
    ngc = dict(good, torch="2.9.0a0+50eac811a6.nv25.10")
    assert versions.known_problems(ngc, "13.0", "13.0", "2.14.0", None) == [
        "vllm 0.33.0 pins torch==2.14.0 but torch 2.9.0a0+50eac811a6.nv25.10 is installed (on an NGC image: its "
        "/etc/pip/constraint.txt kept the image's torch)"]
    problems = versions.known_problems(dict(good, triton="3.5.1", **{"megatron-core": "0.20.0"}), "13.0", "12.8",
                                       "2.14.0", "3.6.0")
    assert problems == ["torch 2.14.0+cu130 pins triton==3.6.0 but triton 3.5.1 is installed",
                        "megatron-core 0.20.0 is outside the tested range 0.16 - 0.19",
                        "torch is built for CUDA 13.0 but the driver supports CUDA 12.8 at most (CUDA 13 needs an "
                        "R580 or newer driver)"]
    assert versions.known_problems(dict(good, **{"megatron-core": None}), None, None, None, None) == [
        "megatron-core is not installed"]
