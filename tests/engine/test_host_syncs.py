"""Host syncs in the hot loops: an engine step reads its sampled tokens back once, a drafter its k guesses once,
a step's index tensors cross to the device in one copy, and collectives are timed without a sync each."""
from __future__ import annotations

import pytest
import torch

from llminfer.engine import LLMEngine, SamplingParams
from llminfer.engine.attention_metadata import to_device
from llminfer.parallel import CommStats
from small_models import SMALL_CONFIGS, random_model


class _Reads:
    """Counts the ways a tensor's values reach Python while active."""

    NAMES = ("item", "tolist", "__int__", "__bool__", "__index__", "__float__")

    def __init__(self, monkeypatch):
        self.count, self.monkeypatch, self.real = 0, monkeypatch, {n: getattr(torch.Tensor, n) for n in self.NAMES}

    def __enter__(self):
        for name in self.NAMES:
            def counted(tensor, *args, _name=name, **kwargs):
                self.count += 1
                return self.real[_name](tensor, *args, **kwargs)
            self.monkeypatch.setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            self.monkeypatch.setattr(torch.Tensor, name, self.real[name])


def test_an_engine_step_reads_its_sampled_tokens_back_once(monkeypatch):
    model = random_model(SMALL_CONFIGS["qwen2-bias-gqa"])
    engine = LLMEngine(model, block_size=16, num_blocks=32, max_num_seqs=4, max_model_len=64)
    params = [SamplingParams(max_new_tokens=4, temperature=0.8, seed=s) for s in range(3)] + \
        [SamplingParams(max_new_tokens=4)]
    for i, p in enumerate(params):
        engine.add_request([1 + i, 2, 3, 4], p)
    engine.step()                                            # the prefills
    runner_reads = []
    real_execute = engine.runner.execute

    def execute(metadata):
        with _Reads(monkeypatch) as reads:
            out = real_execute(metadata)
        runner_reads.append(reads.count)
        return out
    monkeypatch.setattr(engine.runner, "execute", execute)
    events = engine.step()                                   # four decodes, three of them sampled
    assert len(events) == 4 and runner_reads == [1]          # one .tolist() for the whole step


def test_sampled_tokens_are_the_ones_each_requests_generator_gives():
    """Writing the samples into one device tensor keeps each request's seeded draw: the same seed, the same tokens."""
    model = random_model(SMALL_CONFIGS["qwen2-bias-gqa"])
    runs = []
    for _ in range(2):
        engine = LLMEngine(model, block_size=16, num_blocks=32, max_num_seqs=4, max_model_len=64)
        outs = engine.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(max_new_tokens=6, temperature=1.0, seed=7),
                                                         SamplingParams(max_new_tokens=6, temperature=1.0, seed=8)])
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]


def test_a_drafter_reads_its_guesses_back_once(monkeypatch):
    from llminfer.speculative import DraftModelDrafter

    target = random_model(SMALL_CONFIGS["qwen2-bias-gqa"], seed=0)
    drafter = DraftModelDrafter(random_model(SMALL_CONFIGS["qwen2-bias-gqa"], seed=1))
    want = drafter.propose([1, 2, 3, 4], 5)
    drafter.start(32)
    with _Reads(monkeypatch) as reads:
        got = drafter.propose([1, 2, 3, 4], 5)
    assert got == want and len(got) == 5 and reads.count == 1
    del target


def test_the_step_index_tensors_cross_in_one_packed_copy():
    host = {"positions": [3, 4, 5], "tables": torch.arange(6).view(2, 3), "empty": [], "one": [9]}
    packed = to_device(host, "cpu", pack=True)
    plain = to_device(host, "cpu", pack=False)
    for name in host:
        assert packed[name].dtype == torch.long and torch.equal(packed[name], plain[name]), name
    storages = {t.untyped_storage().data_ptr() for t in packed.values() if t.numel()}
    assert len(storages) == 1                                # views of one tensor: one copy moved them all
    assert packed["tables"].shape == (2, 3) and packed["empty"].shape == (0,)


def test_collectives_are_counted_and_timed_per_kind_without_a_cuda_device():
    stats = CommStats()
    with stats.recording():
        stats.run("all_reduce", torch.ones(8), lambda: None)
        stats.run("all_gather", torch.ones(2, 4, dtype=torch.float16), lambda: None)
        stats.run("all_reduce", torch.ones(8), lambda: None)
    stats.run("all_reduce", torch.ones(8), lambda: None)    # outside the recording: not counted
    assert stats.calls == 3 and stats.nbytes == 32 + 16 + 32
    assert stats.by_kind["all_reduce"][:2] == [2, 64] and stats.by_kind["all_gather"][:2] == [1, 16]
    assert stats.seconds == pytest.approx(sum(v[2] for v in stats.by_kind.values())) and stats.seconds >= 0
    stats.reset()
    assert stats.calls == 0 and stats.seconds == 0.0 and stats.by_kind == {}


@pytest.mark.gpu
def test_collectives_on_cuda_are_timed_by_events_read_after_the_recording():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    stats = CommStats()
    x = torch.ones(1 << 20, device="cuda")
    with stats.recording():
        stats.run("all_reduce", x, lambda: x.mul_(1.0))
        assert stats._pending                             # not read yet: no sync inside the recording
    assert not stats._pending and stats.calls == 1 and stats.seconds > 0
