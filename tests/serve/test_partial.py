"""Partial rollouts on an engine (`stapo_megatron.serve.partial.PartialPool`) with the real HF
engine on a tiny model: rounds counted in tokens, the first finished groups in admission order,
the rest continued by the next step under newer weights (each token keeping its version), windows
of the data order taken once, and the same inputs giving the same steps."""

import json

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.data.tokenizer import build_char_tokenizer
from stapo_megatron.rollout.config import RolloutConfig, SamplingSettings
from stapo_megatron.rollout.hf_engine import HFEngine
from stapo_megatron.batch.records import make_records
from stapo_megatron.batch.step_rollout import StepRollout
from stapo_megatron.mcore.parallel import Groups
from stapo_megatron.rollout.config import RolloutSampling
from stapo_megatron.rollout.rollout_modes import PartialRollouts, SeparatePlacement
from stapo_megatron.serve.partial import PartialPool
from stapo_megatron.trainer.pool_ledger import PoolLedger, partial_metrics

MAX_TOKENS, ROUND, G = 12, 4, 2
SEED = 160_112
"""Step s's pool seed is SEED + 100 s: with it a group is still unfinished when its step has its
groups, so the next step continues it (most seeds let every group of this tiny model end in the
same round; found by trying seeds)."""
PROMPTS = [[5, 17, 20, 3], [42] * 6, [1, 2, 3, 4, 5], [7, 7, 9], [11, 12], [30, 31, 32, 33]]


EOS = 3
"""The tiny folders' end token: its output row is tripled so that responses end at varied lengths
(with none, every response would run to the limit and every group finish in the same round)."""


def _weights(folder):
    state = HFEngine(folder, RolloutConfig(dtype="float32")).model.state_dict()
    state["lm_head.weight"][EOS] *= 3
    return state


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A maker of engines holding version 0, and version 1's weights."""
    root = tmp_path_factory.mktemp("partial")
    for name, seed in (("v0", 0), ("v1", 1)):
        folder = str(root / name)
        save_tiny_hf_model(folder, "qwen3", dtype=torch.float32, seed=seed)
        build_char_tokenizer(folder)
        config = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    v0, v1 = _weights(str(root / "v0")), _weights(str(root / "v1"))

    def make():
        engine = HFEngine(str(root / "v0"), RolloutConfig(dtype="float32"))
        engine.update_weights(iter(v0.items()))
        return engine

    return make, v1


def _window(step, per_step=3, extra=1):
    """Positions and indices of a replica's data order: step s's prompts and the next one's first."""
    pairs = [(p, p, PROMPTS[p % len(PROMPTS)]) for p in range(step * per_step, (step + 1) * per_step + extra)]
    return pairs


def _run(engine, v1, steps=3):
    pool, out = PartialPool(), []
    for step in range(steps):
        if step == 1:
            engine.update_weights(iter(v1.items()))  # the engine's weights change between steps
        groups = pool.step(engine, _window(step), SamplingSettings(G, 1.0, 1.0, MAX_TOKENS, SEED + 100 * step),
                           want=3, capacity=4, round_tokens=ROUND, version=step)
        out.append([(g.index, [(s.token_ids, s.versions, s.finish_reason) for s in g.samples]) for g in groups])
    return pool, out


def test_steps_return_finished_groups_in_admission_order_and_continue_the_rest(engines):
    make, v1 = engines
    pool, out = _run(make(), v1)
    for step, groups in enumerate(out):
        assert len(groups) == 3  # want
        indices = [i for i, _ in groups]
        assert indices == sorted(indices)  # admission (data) order among the finished ones
        for _, samples in groups:
            assert len(samples) == G
            for tokens, versions, finish in samples:
                assert finish == "stop" or len(tokens) == MAX_TOKENS  # finished
                assert len(versions) == len(tokens) and versions == sorted(versions)
    # every prompt of the data order taken once: the windows overlap, the pool never repeats one
    taken = [i for groups in out for i, _ in groups]
    assert len(taken) == len(set(taken))
    # over-sampling: the pool kept a group past the steps (capacity 4, 3 taken per step)
    assert len(pool.groups) + len(pool.waiting) >= 1
    # a response left unfinished when its step had enough groups was continued by the next step's
    # policy: its first tokens carry one version, its last a later one
    assert any(v[0] < v[-1] for groups in out for _, samples in groups for _, v, _ in samples)


def test_the_same_inputs_give_the_same_steps(engines):
    make, v1 = engines
    assert _run(make(), v1)[1] == _run(make(), v1)[1]


def test_the_token_age_bound_masks_older_tokens_and_the_step_reports_their_ages(engines):
    """One step ahead (the pool's step i runs with the weights of version i and trains at step
    T = i + 1, k = 1): a response continued from the step before has tokens of age 2, which
    max_token_age = 1 leaves out of the loss while its newer tokens train; the metrics give the
    largest and mean age and the masked count."""
    make, v1 = engines
    engine, pool, found = make(), PartialPool(), None
    for step in range(4):
        groups = pool.step(engine, _window(step), SamplingSettings(G, 1.0, 1.0, MAX_TOKENS, SEED + 100 * step),
                           want=3, capacity=4, round_tokens=ROUND, version=step)
        samples = [g.samples for g in groups]
        if found is None and any(min(s.versions) < step for group in samples for s in group):
            found = step + 1, samples
    assert found is not None  # the case the bound is for: a response continued over two steps
    T, samples = found
    versions = [v for group in samples for s in group for v in s.versions]
    config = RolloutSampling(mode="partial", separate=SeparatePlacement(1, 1), partial=PartialRollouts(max_token_age=1))
    rollout = StepRollout.of_groups(T, [(i, [1]) for i in range(len(samples))], str, samples, G)
    records = make_records(rollout, torch.zeros(len(samples), G), updates_per_step=2,
                           token_age_bound=config.token_age_bound)
    for rec, s in zip(records, [s for group in samples for s in group]):
        assert rec.version == 2 * min(s.versions)
        kept = [T - v <= 1 for v in s.versions]
        assert (rec.loss_mask is None and all(kept)) or rec.loss_mask.tolist() == kept
    row = partial_metrics(rollout, config, {}, Groups(None, None, None, True, 0), torch.device("cpu"))
    assert row["token_age_max"] == T - min(versions) == 2
    assert row["token_age_mean"] == pytest.approx(sum(T - v for v in versions) / len(versions), rel=1e-12)
    assert row["token_age_masked"] == sum(T - v > 1 for v in versions) > 0


def _train_with_a_kill(engine, with_account: bool, steps=6, killed_at=3):
    """The trainers' side of k = 1 over one replica's pool: steps 0 and 1 asked at the start,
    step s + 2 after step s trains; the checkpoint after step ``killed_at`` - 1, then a kill (the
    engine's pool is lost) and a resume. Returns the positions trained, in order, and the ledger."""
    ledger, pool, replies, trained, saved = PoolLedger(), PartialPool(), {}, [], None

    def submit(step):
        window = _window(step, extra=3)
        if with_account:
            window = ledger.window(window, lambda p: (p, p, PROMPTS[p % len(PROMPTS)]))
        # the engine runs its queue in order: the reply is the pool's step on this window
        replies[step] = pool.step(engine, window, SamplingSettings(G, 1.0, 1.0, 4 * MAX_TOKENS, 100 * step),
                                  want=3, capacity=6, round_tokens=ROUND, version=0)

    submit(0), submit(1)
    for step in range(steps):
        if step == killed_at:  # resume: a new engine (empty pool), the checkpoint's account
            ledger, pool = PoolLedger(), PartialPool()
            ledger.load_state_dict(saved)
            submit(step), submit(step + 1)
        indices = [g.index for g in replies.pop(step)]
        trained += ledger.trained(indices) if with_account else indices
        submit(step + 2)
        if step + 1 == killed_at:
            saved = ledger.state_dict()
    return trained, ledger


def test_a_kill_and_resume_trains_every_data_position_once(engines):
    """Windows overlap (over-sampling) and groups finish out of order, so at the checkpoint the
    pool holds positions the data order has passed: without the trainers' account a resumed pool
    retrains some and never trains others; with it (`PoolLedger`, in the checkpoint) every
    position trains once, the ones in flight at the kill started over."""
    make, _ = engines
    # the end token's row six times its own: responses of 1 token to the limit, so groups
    # finish out of admission order
    varied = {k: v.clone() for k, v in make().model.state_dict().items()}
    varied["lm_head.weight"][EOS] *= 2

    def engine():
        e = make()
        e.update_weights(iter(varied.items()))
        return e

    trained, ledger = _train_with_a_kill(engine(), with_account=True)
    assert len(trained) == len(set(trained)) == 6 * 3
    # nothing skipped: what did not train is still in flight
    assert sorted(trained + list(ledger.in_flight)) == list(range(ledger.sent_upto))
    # the case the account is for: a fresh pool fed the resumed steps' windows trains again
    # positions that trained before the kill, out of order
    plain, _ = _train_with_a_kill(engine(), with_account=False)
    assert len(plain) > len(set(plain))


def _byte_level_tokenizer(folder):
    """A byte-level tokenizer (GPT-2's byte alphabet, no merges): one token per byte, so a
    multi-byte UTF-8 character is several tokens and decodes only from all of them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])  # id 256
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end|>", "clean_up_tokenization_spaces": False}))


def test_a_continued_response_is_scored_on_the_text_of_all_its_tokens(tmp_path):
    """Rounds of 3 byte tokens split multi-byte characters: the text a reward reads is the
    decode of the whole response, not the rounds' texts joined (which hold U+FFFD halves)."""
    from transformers import AutoTokenizer

    save_tiny_hf_model(str(tmp_path), "qwen3", dtype=torch.float32, seed=0)
    _byte_level_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    engine = HFEngine(str(tmp_path), RolloutConfig(dtype="float32"))
    pool, split, samples = PartialPool(), 0, []
    window = [(p, p, PROMPTS[p]) for p in range(len(PROMPTS))]
    for step in range(2):
        groups = pool.step(engine, window, SamplingSettings(G, 1.0, 1.0, 30, 7 + 100 * step), want=3, capacity=6,
                           round_tokens=3, version=step)
        samples += [s for g in groups for s in g.samples]
    for s in samples:
        whole = tokenizer.decode(s.token_ids, skip_special_tokens=True)
        rounds = "".join(tokenizer.decode(s.token_ids[k:k + 3], skip_special_tokens=True)
                         for k in range(0, len(s.token_ids), 3))
        split += whole != rounds
        assert s.text == whole
    assert split >= 1  # the case the test is for: a character straddles a round boundary
