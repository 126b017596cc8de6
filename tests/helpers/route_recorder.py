"""What router replay really routed: every call of megatron-core's ``RouterReplay.get_replay_topk``
(the replayed forward and, with full recomputation, the rerun in backward) recorded with its
action and the experts it returned, and compared with the micro-batches' replay targets.

    with RouteRecorder(model) as recorder:
        ... the passes over micro-batches mbs ...
    recorder.mismatches(mbs, num_experts)   # {"forward": calls, "recompute": calls, "mismatched": tokens}

A recomputation that routed by itself instead of replaying shows up as mismatched (token, layer)
pairs, or as fewer "recompute" calls than micro-batches.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch


class RouteRecorder:
    """Wraps each MoE router's ``get_replay_topk`` of ``model`` for the duration of the block."""

    def __init__(self, model):
        from stapo_megatron.mcore.router_replay import replay_routers

        self.replays = replay_routers(model)
        self.calls: List[Tuple[int, str, torch.Tensor]] = []  # (0-based layer, action, [N, K] experts)

    def __enter__(self) -> "RouteRecorder":
        for layer, replay in self.replays:
            original = replay.get_replay_topk

            def recorded(scores, *args, layer=layer, replay=replay, original=original, **kwargs):
                action = replay.router_replay_action  # before the call: REPLAY_BACKWARD pops the FIFO
                probs, indices = original(scores, *args, **kwargs)
                self.calls.append((layer, getattr(action, "value", "own"), indices.detach().cpu()))
                return probs, indices

            replay.get_replay_topk = recorded
        return self

    def __exit__(self, *exc) -> None:
        for _, replay in self.replays:
            del replay.get_replay_topk  # the class's method again

    def mismatches(self, microbatches: Sequence, num_experts: int) -> Dict[str, int]:
        """Calls per action and (token, layer) pairs whose experts differ from the targets: the
        i-th "replay_forward" (and "replay_backward") call of a layer against micro-batch i."""
        from stapo_megatron.mcore.router_replay import replay_indices

        want = [replay_indices(mb, num_experts) for mb in microbatches]  # [N, L, K] each
        counts = {"forward": 0, "recompute": 0, "own": 0, "mismatched": 0}
        seen: Dict[Tuple[int, str], int] = {}
        for layer, action, got in self.calls:
            key = {"replay_forward": "forward", "replay_backward": "recompute"}.get(action, "own")
            counts[key] += 1
            i = seen.get((layer, key), 0)
            seen[(layer, key)] = i + 1
            if key == "own" or i >= len(want):
                counts["mismatched"] += got.shape[0]
                continue
            counts["mismatched"] += int((got != want[i][:, layer]).any(-1).sum())
        return counts
