"""Weighted mixtures of corpora (data.name=mixture, jaxaccel.data.mixing): the weights kept over
a long stream, each source read in its own order and never twice in an epoch, exact mid-epoch
resume, disjoint process shares, bad mixtures refused, and the mixture end to end through the
CLI (data prepare, data show, train and its resume)."""
import json
import re

import numpy as np
import pytest

from jaxaccel import config
from jaxaccel.data.mixing import Interleave, MixedBatches, MixedExamples
from jaxaccel.data.packing import KEYS, PackedBatches
from jaxaccel.data.pipeline import Tokenized
from jaxaccel.train.run import resolve
from support import logged_losses, run_cli

WEIGHTS = [5, 3, 2]


def test_the_interleave_keeps_the_weights_and_each_sources_order():
    """Over a long stream the proportions are the weights (within two rows at each block's
    end, whatever the weights); each source's rows come in its own order 0, 1, 2, ...; any
    stretch of the stream is located as the whole stream has it; the order is the seed's."""
    block = 64
    mix, n = Interleave(WEIGHTS, 7, block), 1000 * block + 23
    source, row = mix.locate(0, n)
    np.testing.assert_allclose(np.bincount(source) / n, np.array(WEIGHTS) / sum(WEIGHTS),
                               atol=0.01)
    for weights in (WEIGHTS, [0.001, 1, 3.3]):
        share = np.array(weights) / sum(weights)
        for blocks in (1, 7, 77):
            taken = Interleave(weights, 0, block).taken(blocks * block)
            assert np.abs(taken - blocks * block * share).max() < 2
    for c in range(3):
        np.testing.assert_array_equal(row[source == c], np.arange((source == c).sum()))
        assert mix.row_of(c, 1000) == np.flatnonzero(source == c)[1000]
    np.testing.assert_array_equal(mix.taken(n), np.bincount(source))
    part = Interleave(WEIGHTS, 7, block).locate(5 * block - 10, 5 * block + 10)
    np.testing.assert_array_equal(part[0], source[5 * block - 10:5 * block + 10])
    np.testing.assert_array_equal(part[1], row[5 * block - 10:5 * block + 10])
    assert not np.array_equal(Interleave(WEIGHTS, 8, block).locate(0, block)[0], source[:block])


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
    epochs, mix = [list(mixed.batches(e)) for e in (0, 1)], mixed.mixture
    per = mixed.steps_per_epoch
    assert len(epochs[0]) == per > 0 and mix.rows_per_epoch == per * 8
    order = np.concatenate([mix.rows(e, s)[0] for e in (0, 1) for s in range(per)])
    taken = mix.taken()
    np.testing.assert_array_equal(taken, np.bincount(order[:per * 8], minlength=3))
    first = mix.first_out
    assert taken[first] <= mix.sizes[first] < taken[first] + 8      # it runs out within a batch
    assert np.all(taken <= mix.sizes)                                # no row twice an epoch
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


def test_mixed_examples_take_each_split_in_its_own_order_resume_and_split_over_processes():
    """Labelled splits mixed: each split's examples, in the order of the stream, are its own
    (seed, epoch) permutations one after another; batches pad to their longest row, resume
    from any step and split over two processes as the plain batches do."""
    rng = np.random.default_rng(0)
    parts = [Tokenized([rng.integers(1, 50, rng.integers(1, 30)).astype(np.int32)
                        for _ in range(n)], np.full(n, c, np.int32), 32)
             for c, n in enumerate((90, 40))]
    mixed = MixedExamples(parts, [1, 1], 8, seed=5, pad_multiple=8)
    per, mix = mixed.steps_per_epoch, mixed.mixture
    assert mix.first_out == 1 and per > 0 and mix.taken()[1] <= 40 < mix.taken()[1] + 8
    for e in (0, 1):
        plan = np.concatenate(mixed.plan(e))
        source = np.concatenate([mix.rows(e, s)[0] for s in range(per)])
        np.testing.assert_array_equal(mixed.data.labels[plan], source)    # labels tell sources
    stream = np.concatenate([np.concatenate(mixed.plan(e)) for e in range(3)])
    for c, n in enumerate((90, 40)):
        own = np.concatenate([np.random.default_rng((5, e)).permutation(n) for e in range(5)])
        got = stream[mixed.data.labels[stream] == c] - mixed.offsets[c]
        np.testing.assert_array_equal(got, own[:len(got)])
    whole = list(mixed.batches(1))
    assert all(b["input_ids"].shape[1] % 8 == 0 for b in whole)
    for a, b in zip(mixed.batches(1, per // 2), whole[per // 2:]):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    halves = [list(MixedExamples(parts, [1, 1], 8, seed=5, pad_multiple=8, process_index=p,
                                 process_count=2).batches(1)) for p in (0, 1)]
    for step, b in enumerate(whole):
        np.testing.assert_array_equal(np.concatenate([h[step]["labels"] for h in halves]),
                                      b["labels"])


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
    with pytest.raises(ValueError, match=r"data.mixture\[1\] \(synthetic\) holds tokens data"):
        resolve(config.build(sets=sets + ["model.name=tiny", f"data.mixture={tasks!r}"]))


@pytest.mark.long
def test_a_mixture_through_the_cli_prepares_shows_trains_and_resumes(tmp_path, capsys, caplog):
    """data prepare states the epoch and each source's documents, tokens and realised share;
    data show names each row's source; a run stopped mid-epoch and resumed logs the losses of
    the run that never stopped."""
    sets = mixture_sets(tmp_path)
    argv = [f"--set={s}" for s in sets]
    code, out, err = run_cli(capsys, "data", "prepare", *argv)
    assert code == 0, err
    epoch = re.search(r"train: a mixture of 2 sources; (\d+) steps an epoch, until \[0\] files "
                      r"runs out", out)
    assert epoch, out
    shares = [float(s) for s in re.findall(r"rows an epoch, ([0-9.]+) of them", out)]
    assert shares == pytest.approx([0.75, 0.25], abs=0.01)
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


def test_a_mixture_of_labelled_texts_learns_every_sources_classes(tmp_path, capsys):
    """Two labelled files, classes a/b and b/c: the classifier learns a, b and c, data prepare
    states each source's examples and share, data show names each row's source."""
    mix = []
    for i, labels in enumerate(("ab", "bc")):
        path = tmp_path / f"{labels}.jsonl"
        path.write_text("".join(json.dumps({"text": f"row {j} of source {i}",
                                            "label": labels[j % 2]}) + "\n" for j in range(60)))
        mix.append({"name": "files", "train_files": str(path), "weight": 2 - i})
    sets = [f"workdir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", "model.name=tiny",
            "model.num_labels=3", "data.name=mixture", f"data.mixture={mix!r}",
            "data.holdout=0.1", "train.batch_size=8", "train.eval_batch_size=8"]
    code, out, err = run_cli(capsys, "data", "prepare", *[f"--set={s}" for s in sets])
    assert code == 0, err
    assert re.search(r"\[0\] files, weight 0.667: 54 examples, [0-9,]+ tokens; \d+ rows an "
                     r"epoch, 0.6\d+ of them", out), out
    assert re.search(r"\[0\] test \+ \[1\] test: 12 examples, [0-9,]+ tokens; labels: a \d+, "
                     r"b \d+, c \d+", out), out
    code, out, err = run_cli(capsys, "data", "show", "-n", "6", *[f"--set={s}" for s in sets])
    assert code == 0, err
    shown = re.findall(r"source \[(\d)\] files\):\n  label '(\w)', \d+ tokens: '.*source (\d)",
                       out)
    assert len(shown) == 6 and all(a == c for a, _, c in shown), out
