"""The method: the paper's algorithm on plain tensors, with no Megatron in it.

- ``objective``: the clipped token surrogate, the masked sum and its normaliser, the k3 KL (Eq. 1-3),
  of a micro-batch's `PolicyTokens`.
- ``masks``: the S2T mask (STAPO), the 20-Entropy and random controls, the mini-batch tau_H.
- ``objectives``: `OBJECTIVES`, the per-token losses a mask applies to (dapo, grpo, dual-clip, GSPO,
  CISPO, Clip-Cov, KL-Cov; ``LossConfig.objective``), the `register_objective` decorator and
  `get_objective` (a name or a dotted path).
- ``registry``: `METHODS`, one `Method` per name (mask, threshold statistic, loss options), the
  `register_method` decorator and `get_method` (a name or a dotted path ``pkg.module:fn``).
- ``config``: `LossConfig`, the method's name and constants, and `method_loss_config`.

A new method is one decorated mask function in any module (``@register_method``), named in
``loss.method`` by dotted path, a new objective one decorated builder (``@register_objective``),
named in ``loss.objective`` (docs/extending.md); built-in ones are listed in ``registry.py`` and
``objectives.py``.
"""
