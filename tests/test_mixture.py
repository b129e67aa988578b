"""Weighted mixtures of corpora (data.name=mixture, jaxaccel.data.mixing): the weights kept over
a long stream, each source read in its own order and never twice in an epoch, exact mid-epoch
resume, disjoint process shares, bad mixtures refused, and the mixture end to end through the
CLI (data prepare, data show, train and its resume)."""
import json
import re

import numpy as np
import pytest

from jaxaccel import config
from jaxaccel.data.mixing import BLOCK, Interleave, MixedBatches
from jaxaccel.data.packing import KEYS, PackedBatches
from jaxaccel.train.run import resolve
from support import logged_losses, run_cli

WEIGHTS = [5, 3, 2]


def test_the_interleave_keeps_the_weights_and_each_sources_order():
    """Over a long stream the proportions are the weights (within two rows at each block's
    end, whatever the weights); each source's rows come in its own order 0, 1, 2, ...; any
    stretch of the stream is located as the whole stream has it; the order is the seed's."""
    mix, n = Interleave(WEIGHTS, seed=7), 400 * BLOCK + 123
    source, row = mix.locate(0, n)
    np.testing.assert_allclose(np.bincount(source) / n, np.array(WEIGHTS) / sum(WEIGHTS),
                               atol=0.01)
    for weights in (WEIGHTS, [0.001, 1, 3.3]):
        share = np.array(weights) / sum(weights)
        assert np.abs(Interleave(weights, 0).taken(77 * BLOCK) - 77 * BLOCK * share).max() < 2
    for c in range(3):
        np.testing.assert_array_equal(row[source == c], np.arange((source == c).sum()))
        assert mix.row_of(c, 1000) == np.flatnonzero(source == c)[1000]
    np.testing.assert_array_equal(mix.taken(n), np.bincount(source))
    part = Interleave(WEIGHTS, seed=7).locate(5 * BLOCK - 10, 5 * BLOCK + 10)
    np.testing.assert_array_equal(part[0], source[5 * BLOCK - 10:5 * BLOCK + 10])
    np.testing.assert_array_equal(part[1], row[5 * BLOCK - 10:5 * BLOCK + 10])
    assert not np.array_equal(Interleave(WEIGHTS, seed=8).locate(0, BLOCK)[0], source[:BLOCK])


def _docs(seed, n):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 100, rng.integers(2, 40)).astype(np.int32) for _ in range(n)]


def test_mixed_batches_read_each_source_once_an_epoch_resume_and_split_over_processes():
    """Each source's rows, in the order of the stream, are that source's own packed rows epoch
    after epoch (a run of it alone); the epoch ends as the first source runs out and the next
    goes on where it stopped; batches from any step equal the uninterrupted ones; two
    processes' rows are disjoint halves of every batch."""
    docs = [_docs(0, 300), _docs(1, 60), _docs(2, 150)]
    mixed = MixedBatches(docs, WEIGHTS, 16, 8, seed=3)
    epochs = [list(mixed.batches(e)) for e in (0, 1)]
    per = mixed.steps_per_epoch
    assert len(epochs[0]) == per > 0 and mixed.rows_per_epoch == per * 8
    order = np.concatenate([mixed.sources_of(e, s) for e in (0, 1) for s in range(per)])
    taken = mixed.taken()
    np.testing.assert_array_equal(taken, np.bincount(order[:per * 8], minlength=3))
    first = mixed.first_out
    assert taken[first] <= mixed.rows[first] < taken[first] + 8     # it runs out within a batch
    assert np.all(taken <= mixed.rows)                               # no row twice an epoch
    for c, d in enumerate(docs):
        alone = PackedBatches(d, 16, 8, seed=3)
        own = np.concatenate([alone.rows(e)["input_ids"] for e in range(3)])
        got = np.concatenate([b["input_ids"] for b in epochs[0] + epochs[1]])[order == c]
        np.testing.assert_array_equal(got, own[:len(got)])
    for e in (0, 1):
        for start in (1, per // 2, per - 1):
            for a, b in zip(mixed.batches(e, start), epochs[e][start:]):
                assert all(np.array_equal(a[k], b[k]) for k in KEYS)
        halves = [list(MixedBatches(docs, WEIGHTS, 16, 8, seed=3, process_index=p,
                                    process_count=2).batches(e)) for p in (0, 1)]
        for step, whole in enumerate(epochs[e]):
            for k in KEYS:
                np.testing.assert_array_equal(
                    np.concatenate([halves[0][step][k], halves[1][step][k]]), whole[k])


def _corpus(path, words, n, seed):
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(3, 40)))})
                            + "\n" for _ in range(n)))
    return str(path)


def mixture_sets(tmp_path, *extra):
    """The llama-cpu preset on a mixture of two small corpora (3 rows of the first to 1 of the
    second), its own BPE trained on both."""
    mix = [{"name": "files", "weight": 3, "train_files": _corpus(
                tmp_path / "river.jsonl", ["river", "mill", "rain", "the"], 160, 0)},
           {"name": "files", "weight": 1, "train_files": _corpus(
                tmp_path / "stone.jsonl", ["stone", "bright", "sang", "a"], 60, 1)}]
    return [f"workdir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}",
            "model.name=llama-cpu", "data.name=mixture", f"data.mixture={mix!r}",
            "data.holdout=0.1", "data.tokenizer_vocab=300", "data.max_len=16",
            "train.batch_size=8", "train.eval_batch_size=8", "train.progress=false",
            "train.log_every=1", "train.warmup_ratio=0.0", "train.schedule=constant",
            "model.attention_dropout=0.0", *extra]


def test_bad_mixtures_are_refused(tmp_path):
    sets = mixture_sets(tmp_path)
    mix = config.build(sets=sets).data.mixture
    for bad, message in (
            ([{**mix[0], "weight": 0}, mix[1]], r"weights are \[0, 1\]: each source needs a "
                                                r"weight > 0"),
            ([mix[0], {**mix[1], "weight": -2.0}], r"weights are \[3, -2.0\]"),
            ([{"name": "files", "train_files": "x.jsonl"}], r"weights are \[None\]"),
            ([{**mix[0], "max_len": 32}], "max_len, tokenizer_vocab are the mixture's own keys"),
            ([{"weight": 1}], "each source names its data.name")):
        with pytest.raises(ValueError, match=message):
            config.build(sets=sets + [f"data.mixture={bad!r}"])
    with pytest.raises(KeyError, match=r"data.mixture\[1\]: unknown config key 'data.trian_"
                                       "files'. Close matches: data.train_files"):
        typo = [mix[0], {"name": "files", "weight": 1, "trian_files": "x.jsonl"}]
        config.build(sets=sets + [f"data.mixture={typo!r}"])
    with pytest.raises(ValueError, match="data.name=mixture needs data.mixture"):
        config.build(sets=sets + ["data.mixture=[]"])
    tasks = [mix[0], {"name": "synthetic", "weight": 1}]
    with pytest.raises(ValueError, match=r"data.mixture mixes sources of different tasks: \[0\] "
                                         r"files \(causal_lm\), \[1\] synthetic "
                                         r"\(classification\)"):
        resolve(config.build(sets=sets + [f"data.mixture={tasks!r}"]))


def test_a_mixture_through_the_cli_prepares_shows_trains_and_resumes(tmp_path, capsys, caplog):
    """data prepare states the epoch and each source's documents, tokens and realised share;
    data show names each row's source; a run stopped mid-epoch and resumed logs the losses of
    the run that never stopped."""
    sets = mixture_sets(tmp_path)
    argv = [f"--set={s}" for s in sets]
    code, out, err = run_cli(capsys, "data", "prepare", *argv)
    assert code == 0, err
    epoch = re.search(r"train: a mixture of 2 sources; (\d+) steps an epoch, until \[1\] files "
                      r"runs out", out)
    assert epoch, out
    shares = [float(s) for s in re.findall(r"rows an epoch, ([0-9.]+) of them", out)]
    assert len(shares) == 2 and sum(shares) == pytest.approx(1, abs=2e-3) and shares[0] > 0.6
    assert re.search(r"\[0\] files, weight 0.750: 144 documents, [0-9,]+ tokens", out), out
    per = int(epoch.group(1))
    assert resolve(config.build(sets=sets)).steps_per_epoch == per > 4
    code, out, err = run_cli(capsys, "data", "show", "-n", "3", *argv)
    assert code == 0 and len(re.findall(r"row \d \(step 0, source \[[01]\] files\)", out)) == 3
    code, _, err = run_cli(capsys, "train", *argv, "--set=name=full", "--set=train.max_steps=4")
    assert code == 0, err
    caplog.set_level("INFO", "jaxaccel")
    for steps in (2, 4):
        code, _, err = run_cli(capsys, "train", *argv, "--set=name=part",
                               f"--set=train.max_steps={steps}")
        assert code == 0, err
    assert re.search(r"resumed from \S+ at step 2", caplog.text)
    full, part = logged_losses(tmp_path / "full"), logged_losses(tmp_path / "part")
    assert sorted(part) == [1, 2, 3, 4]
    np.testing.assert_allclose([part[s] for s in (3, 4)], [full[s] for s in (3, 4)], rtol=1e-6)
