"""The images source (jaxaccel.data.images): class folders or a listing, pixels as the
checkpoint's image processor makes them (transformers' own output), seeded augmentation, the
refusals of bad inputs, and a ViT read from a transformers checkpoint fine-tuned, evaluated,
asked with predict --top-k and exported back, through the CLI."""
import json
import os
import re
import shutil

import numpy as np
import pytest

from jaxaccel import config
from jaxaccel.data import images
from jaxaccel.data.spec import DataError
from jaxaccel.train.run import resolve
from support import run_cli

SIZE = 16


def write_images(root, counts, seed=0):
    """Class folders under ``root``: ``counts`` images a class (red, blue), of several sizes,
    as PNG, JPEG and WebP in turn."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for colour, name in enumerate(("red", "blue")):
        os.makedirs(root / name, exist_ok=True)
        for i in range(counts):
            x = rng.integers(0, 80, (20 + i, 24 + 2 * i, 3), dtype=np.uint8)
            x[..., 2 * colour] += 170
            Image.fromarray(x).save(root / name / f"{i}.{('png', 'jpg', 'webp')[i % 3]}")
    return root


@pytest.fixture(scope="module")
def pets(tmp_path_factory):
    """A tiny transformers ViT classifier checkpoint with its image processor, and images."""
    import transformers
    root = tmp_path_factory.mktemp("pets")
    cfg = transformers.ViTConfig(image_size=SIZE, patch_size=8, num_channels=3, hidden_size=32,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, num_labels=2)
    transformers.ViTForImageClassification(cfg).save_pretrained(root / "ckpt")
    with open(root / "ckpt" / images.PROCESSOR_FILE, "w") as f:
        json.dump({"image_processor_type": "ViTImageProcessor", "do_resize": True,
                   "size": {"height": SIZE, "width": SIZE}, "resample": 2, "do_rescale": True,
                   "rescale_factor": 1 / 255, "do_normalize": True,
                   "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.25, 0.3]}, f)
    write_images(root / "train", 8)
    write_images(root / "test", 3, seed=1)
    return root


def image_sets(root, *extra):
    return [f"workdir={root / 'runs'}", f"model.checkpoint={root / 'ckpt'}",
            "model.name=vit-tiny", "model.task=classification", "model.num_labels=2",
            "data.name=images", f"data.train_files={root / 'train'}",
            f"data.eval_files={root / 'test'}", "train.batch_size=8", "train.eval_batch_size=8",
            "train.max_steps=2", "train.progress=false", *extra]


def test_eval_pixels_are_the_checkpoint_processors_own(pets):
    """The processor config is read, not guessed: eval pixels equal what transformers' image
    processor of the checkpoint makes (to PIL's resize rounding)."""
    import transformers
    data = resolve(config.build(sets=image_sets(pets))).data
    assert data.label_names == ("blue", "red") and data.counts == {"train": 16, "test": 6}
    x, labels = data.reader.examples("test")
    assert x.shape == (6, SIZE, SIZE, 3) and labels.tolist() == [0, 0, 0, 1, 1, 1]
    ours = x.pixels(np.arange(6), 0, False)
    ref = transformers.AutoImageProcessor.from_pretrained(pets / "ckpt")
    from PIL import Image
    want = ref([Image.open(p).convert("RGB") for p in x.paths], return_tensors="np")
    np.testing.assert_allclose(ours, want["pixel_values"].transpose(0, 2, 3, 1), atol=1e-5)


def test_augmentation_is_seeded_by_seed_epoch_and_index(pets):
    x, _ = resolve(config.build(sets=image_sets(pets))).data.reader.examples("train")
    rows = np.array([3, 0, 9])
    one = x.pixels(rows, 1, True)
    np.testing.assert_array_equal(one, x.pixels(rows, 1, True))
    np.testing.assert_array_equal(one[1], x.pixels(np.array([0]), 1, True)[0])   # per image
    assert not np.array_equal(one, x.pixels(rows, 2, True))
    assert not np.array_equal(one, x.pixels(rows, 1, False))
    rng = np.random.default_rng(0)
    for _ in range(200):
        left, top, right, bottom = images.crop_box(rng, 30, 20)
        assert 0 <= left < right <= 30 and 0 <= top < bottom <= 20
        assert 3 / 4 - 0.1 <= (right - left) / (bottom - top) <= 4 / 3 + 0.1


def test_a_listing_names_paths_and_labels(pets, tmp_path):
    listing = tmp_path / "train.csv"
    rows = [(os.path.relpath(pets / "train" / c / f"{i}.png", tmp_path), c)
            for c in ("red", "blue") for i in (0, 3)]
    listing.write_text("path,label\n" + "".join(f"{p},{c}\n" for p, c in rows))
    data = resolve(config.build(sets=image_sets(pets, f"data.train_files={listing}",
                                                "data.eval_files="))).data
    assert data.counts == {"train": 4} and data.label_names == ("blue", "red")


@pytest.mark.parametrize("break_it, message", [
    (lambda d: os.makedirs(d / "green"), "the class folder .*green' holds no image"),
    (lambda d: (d / "red" / "x.gif").write_bytes(b"GIF89a"), r"x.gif: .gif is not an image "
                                                                 "format read here"),
    (lambda d: (d / "loose.png").write_bytes(b""), "loose.png is not in a class folder"),
    (lambda d: (d / "red" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really"),
     r"1 image\(s\) cannot be read: .*bad.png: not a readable image"),
    (lambda d: (d / "red" / "cut.jpg").write_bytes((d / "red" / "1.jpg").read_bytes()[:300]),
     r"cut.jpg: not a readable image \((Truncated File Read|image file is truncated)"),
])
def test_bad_images_are_refused_naming_the_file(pets, tmp_path, capsys, break_it, message):
    shutil.copytree(pets / "train", tmp_path / "train")
    break_it(tmp_path / "train")
    sets = image_sets(pets, f"data.train_files={tmp_path / 'train'}")
    code, _, err = run_cli(capsys, "data", "show", "-n", "1", *[f"--set={s}" for s in sets])
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err


def test_one_class_and_a_mismatched_processor_are_refused(pets, tmp_path):
    write_images(tmp_path / "one", 2)
    shutil.rmtree(tmp_path / "one" / "blue")
    with pytest.raises(DataError, match="every image is of the class 'red'"):
        resolve(config.build(sets=image_sets(pets, f"data.train_files={tmp_path / 'one'}")))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / images.PROCESSOR_FILE).write_text(json.dumps(
        {"size": {"height": 224, "width": 224}}))
    with pytest.raises(DataError, match="size 224x224 but the model's input is 16x16"):
        images.processor(str(tmp_path / "p"), (SIZE, SIZE, 3))
    assert images.processor("", (SIZE, SIZE, 3)).mean == (0.5, 0.5, 0.5)


@pytest.mark.long
def test_a_vit_checkpoint_fine_tunes_on_images_and_exports_back(pets, tmp_path, capsys):
    """Train (CLI), eval, predict --top-k and export: transformers reads the exported model and
    its image processor and gives predict's probabilities."""
    import torch
    import transformers
    from PIL import Image
    sets = image_sets(pets, f"workdir={tmp_path}", "name=pets")
    code, out, err = run_cli(capsys, "train", *[f"--set={s}" for s in sets])
    assert code == 0, err
    run_dir = json.loads(out)["run_dir"]
    assert os.path.exists(os.path.join(run_dir, images.PROCESSOR_FILE))
    code, out, err = run_cli(capsys, "eval", "--checkpoint", run_dir)
    assert code == 0, err
    ev = json.loads(out)
    assert ev["examples"] == 6 and ev["label_names"] == ["blue", "red"]
    assert sum(map(sum, ev["confusion_matrix"])) == 6
    image = str(pets / "test" / "red" / "0.png")
    code, out, err = run_cli(capsys, "predict", "--checkpoint", run_dir, "--top-k", "2", image)
    assert code == 0, err
    record = json.loads(out)
    code, out, err = run_cli(capsys, "export", "--checkpoint", run_dir, "--out",
                             str(tmp_path / "hf"))
    assert code == 0, err
    model = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    proc = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        p = model(**proc(Image.open(image).convert("RGB"), return_tensors="pt")).logits.softmax(-1)
    got = {t["label"]: t["probability"] for t in record["top_k"]}
    want = {model.config.id2label[i]: float(p[0, i]) for i in range(2)}
    assert got == pytest.approx(want, abs=1e-4)
