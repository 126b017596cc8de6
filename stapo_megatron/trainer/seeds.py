"""Every seed of a training run, derived from ``TrainerConfig.seed`` in one place.

Which stream seeds what (``seed`` = ``TrainerConfig.seed``, k = the training step, counted from 0):

    stream                      value                                          seeds
    model_init                  ws (+ 100 x pp_rank in parallel.init_parallel) torch (CPU, CUDA) and
                                                                               Megatron's RNG tracker:
                                                                               identical DP replicas
    data_split                  data                                           the generated (reasoning-gym)
                                                                               train / held-out problems
    data_order                  seed (+ epoch)                                 the prompt permutation of
                                                                               each epoch
    warmstart_order             ws + 99 (+ epoch)                              the warm-start's permutation
    engine(dp)                  seed + dp                                      the sampler's global RNG of
                                                                               DP rank dp's engine (used only
                                                                               without a per-call seed)
    rollout(k, dp, m)           H(rollout, seed, k) + dp x m                   step k's samples on DP rank dp
                                                                               (m samples per rank); prompt i,
                                                                               sample j: that + i n + j
                                                                               (rollout engines)
    round_seed(base, r)         H(round, base, r)                              round r of a partial-rollout
                                                                               pool (base: the step's rollout
                                                                               seed); its responses count on
                                                                               from it
    evaluation                  seed + 7                                       every evaluation: the held-out
                                                                               set and each named set and
                                                                               decoding (eval.sets)
    microbatches(k, s, dp)      k x 100_003 + s + dp x 10_007 (+ position)     the micro-batch seeds of the
                                                                               mini-batch starting at
                                                                               sequence s of DP rank dp
    warmstart_microbatches(k)   k (+ position)                                 the same for warm-start step k
    random control (loss)       loss.seed x 1_000_003 + micro-batch seed       ``methods._random_mask``
    CP rank r's part            micro-batch seed + r x 1_000_003               that rank's random-control draw
                                                                               (``batch.context_parallel``)

``ws`` = ``WarmStartConfig.seed`` and ``data`` = ``DataConfig.seed``, each ``seed`` when unset:
fixing them (the demo does) gives every RL seed the same held-out problems and the same
warm-started weights, so seeds differ only in what RL does.

``round_seed`` is `stapo_megatron.serve.partial.round_seed` (the engine ranks' pools draw it).
H is `stapo_megatron.utils.stream_seed`, a 62-bit hash (BLAKE2b) of its parts: each (seed, step) and (step seed, round)
starts its own stream, and a stream's samples count up from it (a step draws at most millions,
against 2^62 starts), so no two samples of a run share a seed: the first sample of step k + 1 is
not the second of step k, and a partial round's responses do not run into the next replica's.
(torch's CPU generator reads a seed's low 32 bits: there two unrelated samples of a long run can
share a seed by chance, at birthday odds, never through the streams' layout.)
1_000_003 is `SEED_STRIDE`, the one constant the modules that use it import. The multipliers keep
the micro-batch streams of different steps and ranks apart. The micro-batch seeds do not depend on ``seed``
(only the random control reads them, combined with ``LossConfig.seed``); the values are those
the runs so far used, so fixed-seed results stay reproducible.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from stapo_megatron.utils import stream_seed



@dataclasses.dataclass(frozen=True)
class Seeds:
    """The seeds of one run (see the module's table)."""

    seed: int
    """``TrainerConfig.seed``."""
    warmstart_seed: Optional[int] = None
    """``WarmStartConfig.seed`` (None = ``seed``)."""
    data_seed: Optional[int] = None
    """``DataConfig.seed`` (None = ``seed``)."""

    @property
    def _ws(self) -> int:
        return self.seed if self.warmstart_seed is None else self.warmstart_seed

    @property
    def model_init(self) -> int:
        """Weights (``parallel.init_parallel`` adds 100 x pp_rank)."""
        return self._ws

    @property
    def data_split(self) -> int:
        """The generated train / held-out problems."""
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def data_order(self) -> int:
        """The training prompts' permutation of epoch e is seeded with this + e."""
        return self.seed

    @property
    def warmstart_order(self) -> int:
        """The warm-start prompts' permutation of epoch e is seeded with this + e."""
        return self._ws + 99

    def engine(self, dp_rank: int = 0) -> int:
        """The rollout engine's own seed on DP rank ``dp_rank``: the ranks' engines are
        independent samplers and must not draw the same noise. The ranks of one vLLM TP group
        share a DP rank (`TrainerConfig` checks that vLLM TP divides Megatron TP), so they
        share the seed, as vLLM requires."""
        return self.seed + dp_rank

    def rollout(self, step: int, dp_rank: int = 0, samples_per_rank: int = 0) -> int:
        """The samples of training step ``step`` (0-based) on DP rank ``dp_rank``, which draws
        ``samples_per_rank`` samples: the rank's first sample is global sample dp_rank x
        samples_per_rank, so every sample of the step gets its own seed, the same one whatever
        the DP size; each step's stream starts at its own hash (`stream_seed`)."""
        return stream_seed("rollout", self.seed, step) + dp_rank * samples_per_rank

    @property
    def evaluation(self) -> int:
        """Every evaluation, held-out and named sets (the same samples' seeds at every evaluation)."""
        return self.seed + 7

    @staticmethod
    def microbatches(step: int, first_sequence: int, dp_rank: int) -> int:
        """The first micro-batch seed of the mini-batch that starts at ``first_sequence`` of
        this DP rank's step ``step`` (``split_microbatches`` adds each micro-batch's offset)."""
        return step * 100_003 + first_sequence + dp_rank * 10_007

    @staticmethod
    def warmstart_microbatches(step: int) -> int:
        """The first micro-batch seed of warm-start step ``step``."""
        return step
