"""The loss's core: log-probabilities, entropies and logit-gradient norms on tensor-parallel
vocabulary-sharded logits, computed without gathering the logits.

- ``logprob_entropy``: `vocab_parallel_logprob_entropy`, the op (its contract, input checks and
  the choice of path), and `vocab_shard`, a TP rank's place in a padded, sharded vocabulary.
- ``combine``: what both paths share: the TP combination (one MAX, one packed SUM) and the
  normalisation to log p, H and sum_v p_v^2.
- ``torch_path``: the torch autograd function (any device; the CPU path and the reference).
- ``triton_path``: the Triton autograd function (CUDA tensors); ``triton_kernels``: its forward and
  backward kernels and their launch shapes per device.
- ``logit_grad``: each token's logit-gradient norm and the step's shares of it (the paper's claim).

The bottom floor of the package: it imports nothing else of ``stapo_megatron`` (``mcore/``'s loss
and schedule, the trainer's metrics and the doctor import it), and Triton only when a Triton path
is chosen.
"""
