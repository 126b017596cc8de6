"""stapo-doctor: each GPU component of the project checked in isolation on the real stack.

One `report.Check` per component (versions, collectives, the fused log-prob/entropy op,
packed and context-parallel attention, the TE spec against the local spec, the vLLM engine with
its sleep/wake and weight sync and the rollout/training mismatch, two STAPO steps), each ending
pass, fail (with the reason) or skipped (with the reason); on the CPU the subset that applies
runs. `cli` is the command (``stapo-doctor``) and the entry of ``launch/doctor.py``.
"""
