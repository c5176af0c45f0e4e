"""Blends: Megatron's per-sample source assignment, realized proportions, per-source epochs, the
blended iterator's determinism across process counts and resumes, and blended stores of every
format against the reference packer."""
from __future__ import annotations

import random

import numpy as np
import pytest

from jaxtrain.data import packing as data
from jaxtrain.data.store import blend as blend_module
from jaxtrain.data.store import loader
from jaxtrain.data.store.blend import BlendSchedule
from jaxtrain.data.store.blend_weights import MAX_PERIOD, integer_weights
from jaxtrain.data.store.memory_source import MemorySource
from jaxtrain.data.store.training_sources import parse_blend
from jaxtrain.data.store.windows import WindowIndex

from data_reference import brute_force_assignment, reference_blend_rows

pytestmark = [pytest.mark.fast]

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "source_ids")


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"random seed: {seed}")  # shown by pytest when a test fails
    return np.random.default_rng(seed)


def decimal_weights(rng):
    """2-6 weights of two decimals, as configs write them (a period of a few hundred samples)."""
    return np.round(rng.uniform(0.05, 1.0, size=int(rng.integers(2, 7))), 2)


def count_decisions(monkeypatch) -> list[int]:
    """Patches blend.assign_block to count the samples it decides: [total so far]."""
    decided = [0]
    original = blend_module.assign_block

    def counting(weights, counts, first, size):
        decided[0] += size
        return original(weights, counts, first, size)

    monkeypatch.setattr(blend_module, "assign_block", counting)
    return decided


def test_assignment_follows_the_largest_lag_and_stays_within_one_sample(rng, monkeypatch):
    monkeypatch.setattr(blend_module, "_BLOCK", 64)  # many block boundaries in a short run
    weights = decimal_weights(rng)
    count = 64 * 7 + int(rng.integers(1, 64))
    want_sources, want_ranks = brute_force_assignment(weights, count)

    schedule = BlendSchedule(weights)
    cut = int(rng.integers(1, count))  # read in two pieces, the second first: blocks recomputed
    late, late_ranks = schedule.assign(cut, count)
    early, early_ranks = schedule.assign(0, cut)
    np.testing.assert_array_equal(np.concatenate([early, late]), want_sources)
    np.testing.assert_array_equal(np.concatenate([early_ranks, late_ranks]), want_ranks)

    # Realized counts after every prefix n stay within one sample of n * weight.
    share = weights / weights.sum()
    counts = np.cumsum(np.eye(len(weights))[want_sources], axis=0)
    prefix = np.arange(1, count + 1)[:, None]
    assert np.abs(counts - prefix * share).max() <= 1.0
    assert np.all(counts[-1] > 0)


def test_a_resume_far_into_the_run_decides_one_period_at_most(rng, monkeypatch):
    """A fresh schedule (a resumed run's) at sample n equals the uninterrupted assignment, and the
    samples it decides to get there are bounded by one period, not by n."""
    monkeypatch.setattr(blend_module, "_BLOCK", 64)
    # Weights whose period passes the two blocks' bound below (equal weights have period 2, and
    # 3 * 2 samples cannot show a resume deciding fewer samples than it skips).
    period = 0
    while period <= 2 * 64:
        weights = decimal_weights(rng)
        period = BlendSchedule(weights).period
    count = 3 * period + int(rng.integers(2, period))
    want_sources, want_ranks = brute_force_assignment(weights, count)
    # The reference itself repeats: period p + A is p's source, each rank a_j further on.
    hundredths = np.round(np.asarray(weights) * 100).astype(np.int64)
    a = hundredths // np.gcd.reduce(hundredths)
    assert a.sum() == period
    np.testing.assert_array_equal(want_sources[period:], want_sources[:-period])
    np.testing.assert_array_equal(want_ranks[period:], want_ranks[:-period] + a[want_sources[:-period]])

    decided = count_decisions(monkeypatch)
    first = count - int(rng.integers(1, min(period, 60)))
    sources, ranks = BlendSchedule(weights).assign(first, count)
    np.testing.assert_array_equal(sources, want_sources[first:])
    np.testing.assert_array_equal(ranks, want_ranks[first:])
    assert decided[0] <= period + 2 * 64 < count

    decided[0] = 0
    far = 10**15 + int(rng.integers(0, period))  # a step no run reaches sample by sample
    sources, ranks = BlendSchedule(weights).assign(far, far + 40)
    position = np.arange(far, far + 40) % period
    np.testing.assert_array_equal(sources, want_sources[position])
    np.testing.assert_array_equal(ranks, want_ranks[position] + (np.arange(far, far + 40) // period) * a[sources])
    assert decided[0] <= period + 2 * 64


def test_integer_weights():
    assert integer_weights([0.7, 0.2, 0.1]).tolist() == [7, 2, 1]  # the decimals, not binary floats
    assert integer_weights(["3", "1"]).tolist() == [3, 1]
    assert integer_weights([1 / 3] * 3).tolist() == [1, 1, 1]
    many_digits = [0.123456789, 0.5, 0.0000123]  # an exact period of ~1e12: rounded instead
    a = integer_weights(many_digits)
    assert a.sum() <= MAX_PERIOD + len(a) and np.all(a >= 1)  # (each rounded: up to half a unit more)
    share = np.asarray(many_digits) / sum(many_digits)
    assert np.abs(a / a.sum() - share).max() <= len(a) / MAX_PERIOD
    with pytest.raises(ValueError, match="positive"):
        integer_weights([0.5, 0.0])


def small_source(rng, name, documents, low=3, high=20, vocab=50):
    docs = [rng.integers(0, vocab, size=int(rng.integers(low, high))) for _ in range(documents)]
    return MemorySource(docs, name=name, vocab_size=vocab, pad_id=vocab)


def blend_reader(sources, weights, seq_len, global_batch, seed, process_index=0, process_count=1):
    windows = [WindowIndex(s, seq_len, loader.document_order(s, seed, (loader.BLEND_STREAM, j)))
               for j, s in enumerate(sources)]
    return loader.BlendBatchAtStep(windows, weights, global_batch, seed, True, process_index, process_count)


def test_blended_rows_follow_the_assignment_and_small_sources_reshuffle_per_epoch(rng):
    seq_len, global_batch = 8, 4
    big, small = small_source(rng, "big", 60), small_source(rng, "small", 8, low=8)
    reader = blend_reader([big, small], [0.75, 0.25], seq_len, global_batch, seed=5)
    small_windows = reader.windows[1].count
    steps = 4 * small_windows  # the small source runs through ~4 epochs
    sources, windows = zip(*(reader.rows(s) for s in range(steps)))
    sources, windows = np.concatenate(sources), np.concatenate(windows)
    want, _ = brute_force_assignment([0.75, 0.25], steps * global_batch)
    np.testing.assert_array_equal(sources, want)

    # Each epoch of the small source is every one of its windows once, each epoch shuffled anew:
    # not one order repeated (with a handful of windows two epochs may well draw the same order,
    # so distinct orders per epoch would be a coin toss; with 6 windows all alike by chance is 1 in 720^3).
    of_small = windows[sources == 1]
    epochs = [of_small[e * small_windows:(e + 1) * small_windows] for e in range(len(of_small) // small_windows)]
    assert len(epochs) >= 3 and small_windows >= 6
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(small_windows))
    assert len({tuple(e.tolist()) for e in epochs}) > 1

    # A row's content is its source's window, and source_ids says which source.
    batch = reader(3)
    local_sources, local_windows = reader.rows(3)
    np.testing.assert_array_equal(batch["source_ids"], local_sources)
    for r, (j, w) in enumerate(zip(local_sources, local_windows)):
        expected = reader.windows[j].examples(np.array([w]))
        for name in ("inputs", "targets", "segment_ids", "positions", "loss_mask"):
            np.testing.assert_array_equal(batch[name][r], expected[name][0], err_msg=name)


def test_blended_iterator_same_global_batch_on_two_processes_and_after_resume(rng):
    seq_len, global_batch = 6, 4
    # b and c run through several epochs in 24 steps, so resumes land in later epochs
    sources = [small_source(rng, "a", 25), small_source(rng, "b", 3), small_source(rng, "c", 4)]
    weights = [0.5, 0.2, 0.3]

    def iterator(process_index=0, process_count=1):
        reader = blend_reader(sources, weights, seq_len, global_batch, 9, process_index, process_count)
        return loader.iterate_steps(reader)

    whole = iterator()
    reference = [next(whole) for _ in range(24)]
    halves = [iterator(p, 2) for p in range(2)]
    for step, batch in enumerate(reference):
        parts = [next(h) for h in halves]
        for name in FIELDS:
            np.testing.assert_array_equal(parts[0][name], batch[name][0::2], err_msg=f"{step} {name}")
            np.testing.assert_array_equal(parts[1][name], batch[name][1::2], err_msg=f"{step} {name}")

    for k in (1, 9, 17):
        it = iterator()
        for _ in range(k):
            next(it)
        state = it.get_state()
        resumed = iterator(1, 2)  # a resume onto another process count: the state is the step
        resumed.set_state(state)
        for step in range(k, 24):
            got = next(resumed)
            for name in FIELDS:
                np.testing.assert_array_equal(got[name], reference[step][name][1::2], err_msg=f"{k} {name}")


def test_per_source_token_counts(rng):
    batch = {"loss_mask": rng.integers(0, 2, size=(6, 5)).astype(np.float32),
             "source_ids": np.array([2, 0, 2, 1, 0, 2], np.int32)}
    counts = loader.source_token_counts(batch, 4)
    want = [sum(batch["loss_mask"][r].sum() for r in range(6) if batch["source_ids"][r] == j) for j in range(4)]
    np.testing.assert_array_equal(counts, want)


@pytest.mark.parametrize("blend, message", [
    (("0.7", "a.txt", "0.3"), "must alternate weights and sources"),
    (("a.txt", "0.7", "b.txt", "0.3"), "'a.txt' .* is not a weight"),
    ((0.7, "a.txt", 0, "b.txt"), "b.txt: blend weight 0 must be a positive number"),
    (("0.5", "a.txt", "-1", "b.txt"), "b.txt: blend weight '-1' must be a positive number"),
])
def test_bad_blends(blend, message):
    with pytest.raises(ValueError, match=message):
        parse_blend(blend)


def test_blend_config_trains_on_raw_files(tmp_path, rng):
    """DataConfig.blend end to end with raw files: rows come from the file the assignment names."""
    words = ["alpha", "beta", "gamma"]
    paths = []
    for j, word in enumerate(words):
        path = tmp_path / f"{word}.txt"
        path.write_text("\n\n".join(f"{word} {i}" for i in range(20 + 10 * j)), encoding="utf-8")
        paths.append(str(path))
    cfg = data.DataConfig(blend=(0.5, paths[0], "0.25", paths[1], 0.25, paths[2]), eval_files=(paths[0],))
    it = data.make_train_iterator(cfg, seq_len=16, global_batch=8, seed=1)
    want, _ = brute_force_assignment([0.5, 0.25, 0.25], 8 * 5)
    for step in range(5):
        batch = next(it)
        np.testing.assert_array_equal(batch["source_ids"], want[step * 8:(step + 1) * 8])
        for row, j in zip(batch["inputs"], batch["source_ids"]):
            text = bytes(int(t) for t in row if t < 256).decode()
            assert all(w in words[j] for w in text.split() if w.isalpha()), (text, words[j])


def test_blend_of_chat_text_and_prompt_completion_stores_packs_like_the_reference(tmp_path, rng):
    """Stores of three formats written by prepare, blended: every row (its loss mask above all:
    a chat source trains only the assistant turns' targets) is its source's reference window."""
    from jaxtrain.data.store.prepare import prepare
    from jaxtrain.data.store.readers import open_source
    from store_helpers import make_chat_tokenizer, source_documents, source_masks
    from test_data import WORDS, random_documents, write_txt
    from test_prepare import random_conversations, write_records

    tokenizer = make_chat_tokenizer(tmp_path / "tok", [" ".join(WORDS)] * 4)
    chat = write_records(tmp_path / "chat.jsonl", [{"messages": m} for m in random_conversations(rng, 12)])
    text = write_txt(tmp_path / "text.txt", random_documents(rng, 15, max_words=12))
    pairs = random_documents(rng, 16, max_words=6)
    completion = write_records(tmp_path / "pc.jsonl", [{"prompt": pairs[i], "completion": pairs[i + 1]}
                                                       for i in range(0, 16, 2)])
    stores = [prepare([chat], tokenizer, tmp_path / "chat", workers=1, data_format="chat").out,
              prepare([text], tokenizer, tmp_path / "text", workers=1).out,
              prepare([completion], tokenizer, tmp_path / "pc", workers=1, data_format="prompt_completion").out]
    sources = []
    for store in stores:
        source = open_source(store)
        sources.append((source_documents(source), source_masks(source) if source.has_loss_mask else None,
                        source.pad_id))
    assert [masks is not None for _, masks, _ in sources] == [True, False, True]

    weights, seq_len, global_batch, steps, seed = (0.5, 0.3, 0.2), 12, 8, 6, int(rng.integers(0, 1000))
    blend = tuple(x for pair in zip(weights, map(str, stores)) for x in pair)
    cfg = data.DataConfig(blend=blend, eval_files=(str(stores[1]),), tokenizer=tokenizer)
    iterator = data.make_train_iterator(cfg, seq_len=seq_len, global_batch=global_batch, seed=seed)
    want = reference_blend_rows(sources, weights, seq_len, seed, steps * global_batch)
    for step in range(steps):
        batch = next(iterator)
        for r in range(global_batch):
            expected = want[step * global_batch + r]
            for name in FIELDS:
                np.testing.assert_array_equal(batch[name][r], np.asarray(expected[name]), err_msg=f"{step} {r} {name}")
    # The masks matter here: rows of the masked sources hold untrained targets inside a document.
    untrained = [any(untrained_within_documents(w) for w in want if w["source_ids"] == j) for j in range(3)]
    assert untrained == [True, False, True]


def untrained_within_documents(row) -> bool:
    """Whether a target whose input and next input share a document is not trained."""
    segments, trained = np.asarray(row["segment_ids"]), np.asarray(row["loss_mask"])
    same = (segments[:-1] > 0) & (segments[1:] == segments[:-1])
    return bool(np.any(same & (trained[:-1] == 0)))
