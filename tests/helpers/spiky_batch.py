"""A micro-batch whose sampled tokens are sometimes rare (p < tau_p) under a confident
distribution: what the STAPO mask silences, for the loss and method tests."""

import torch

from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy


def _spiky_batch(seed=0, B=8, S=12, V=64):
    """Logits where some sampled tokens are rare (p < tau_p) under a confident distribution."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=gen)
    logits[..., 0] += torch.rand(B, S, generator=gen) * 12  # confident on token 0: low H
    labels = torch.randint(1, V, (B, S), generator=gen)
    logprob, entropy = vocab_parallel_logprob_entropy(logits, labels)
    adv = torch.tensor([1.0, -1.0] * (B // 2))[:, None].expand(B, S).contiguous()
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, :3] = False  # prompt
    batch = MicroBatch(tokens=labels, position_ids=torch.arange(S).expand(B, S), labels=labels, response_mask=mask,
                       advantages=adv, old_logprob=logprob.detach())
    return logits, logprob, entropy, batch
