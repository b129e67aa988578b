"""Images for a ViT classifier (``data.name=images``): a folder of class sub-folders of JPEG,
PNG or WebP files, or a CSV/JSONL listing of (path, label); each image resized and normalised
as the model checkpoint's image processor says.

    data.name=images data.train_files=pets/train data.eval_files=pets/test   # pets/*/x.jpg
    data.name=images data.train_files=pets/train.csv data.holdout=0.1        # path,label

* Files: in a folder, a file's class is its first folder level under the root (torchvision's
  ``ImageFolder`` rule: ``root/cat/2024/a.jpg`` is a ``cat``), classes sorted; every class
  folder must hold an image, and every file under them be ``.jpg``/``.jpeg``/``.png``/``.webp``
  (hidden files skipped). A listing (``.csv`` with a header, or ``.jsonl``) names each image's
  ``path`` (relative to the listing's folder, or absolute) and its ``data.label_field``.
  Without ``data.eval_files`` the eval split is ``data.holdout`` of the training images.
* Every image of a split is decoded once when its batches are made (threads): a corrupt,
  truncated or unidentifiable file is refused there, each such file named with Pillow's
  reason, before any step.
* Pixels (``Processor``): transformers' ``preprocessor_config.json`` of ``model.checkpoint``
  is read (``image_mean``, ``image_std``, ``rescale_factor``, ``resample``, the ``do_*``
  switches; a ``size`` of height/width must be the model's ``image_size``); without a
  checkpoint, or a checkpoint without the file, ``ViTImageProcessor``'s defaults: mean and std
  0.5, rescale 1/255, bilinear. Eval images are resized to the model's input whole (as
  ``ViTImageProcessor`` does, no crop); training images get a random resized crop (area 8-100%
  of the image, aspect 3/4 to 4/3, torchvision's ``RandomResizedCrop``) and a horizontal flip
  with probability 1/2, drawn from (seed, epoch, the image's index): the same batches on every
  resume. RGB for 3 channels, greyscale for 1.
"""
from __future__ import annotations

import concurrent.futures
import csv
import dataclasses
import json
import os

import numpy as np

from jaxaccel import storage
from jaxaccel.data import filesplits
from jaxaccel.data.spec import DataError, DataMissing, DataSpec

EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
LISTINGS = (".csv", ".jsonl")
PROCESSOR_FILE = "preprocessor_config.json"
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


@dataclasses.dataclass(frozen=True)
class Processor:
    """How an image becomes the model's input: ``size`` (height, width), ``channels``,
    ``x * rescale`` then ``(x - mean) / std`` per channel, resized with PIL's ``resample``."""

    size: tuple[int, int]
    channels: int
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = 2                   # PIL.Image.BILINEAR, ViTImageProcessor's default

    def to_config(self) -> dict:
        """As transformers' ``ViTImageProcessor`` writes its ``preprocessor_config.json``."""
        return {"image_processor_type": "ViTImageProcessor", "do_resize": True,
                "size": {"height": self.size[0], "width": self.size[1]},
                "resample": self.resample, "do_rescale": True, "rescale_factor": self.rescale,
                "do_normalize": True, "image_mean": list(self.mean[:self.channels]),
                "image_std": list(self.std[:self.channels])}

    def normalise(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [..., height, width(, channels)] -> float32, normalised."""
        mean, std = (np.asarray(v, np.float32)[:self.channels] for v in (self.mean, self.std))
        if self.channels == 1:
            mean, std = mean[0], std[0]
        return ((pixels.astype(np.float32) * self.rescale - mean) / std).astype(np.float32)


def processor(folder: str, shape: tuple[int, ...]) -> Processor:
    """The ``Processor`` of the folder ``folder`` (a checkpoint's, or a trained run's: its
    ``PROCESSOR_FILE``; "" = random init: the defaults) for a model whose input is ``shape``
    ([height, width(, channels)])."""
    size, channels = tuple(shape[:2]), (shape[2] if len(shape) == 3 else 1)
    path = storage.join(folder, PROCESSOR_FILE) if folder else ""
    if not path or not storage.exists(path):
        return Processor(size, channels)
    c = json.loads(storage.read_text(path))
    want = c.get("size") or {}
    if isinstance(want, dict) and "height" in want and \
            (want["height"], want["width"]) != size and c.get("do_resize", True):
        raise DataError(f"{path}: size {want['height']}x{want['width']} but the model's input "
                        f"is {size[0]}x{size[1]} (its config.json's image_size); make them "
                        "agree.")
    mean, std = c.get("image_mean", (0.5,) * 3), c.get("image_std", (0.5,) * 3)
    mean, std = ([v] if isinstance(v, (int, float)) else list(v) for v in (mean, std))
    if c.get("do_normalize", True) is False:
        mean, std = [0.0], [1.0]
    mean, std = (tuple(v * channels if len(v) == 1 else v) for v in (mean, std))
    rescale = c.get("rescale_factor", 1 / 255) if c.get("do_rescale", True) else 1.0
    return Processor(size, channels, mean, std, rescale, c.get("resample", 2))


def decode(path: str, channels: int):
    """The PIL image of ``path``, fully decoded, RGB (3 channels) or greyscale (1);
    ``DataError`` naming the file for one Pillow cannot read."""
    from PIL import Image
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB" if channels == 3 else "L")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"{path}: not a readable image ({e}); replace or remove the file.")


def crop_box(rng: np.random.Generator, width: int, height: int) -> tuple[int, int, int, int]:
    """A random resized crop's (left, top, right, bottom): torchvision's ``RandomResizedCrop``
    draw (10 tries of an area in ``SCALE`` and a log-uniform aspect in ``RATIO``), else the
    whole image's centre at the nearest allowed aspect."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = np.exp(rng.uniform(*np.log(RATIO)))
        w, h = round(np.sqrt(target * aspect)), round(np.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.integers(0, width - w + 1), rng.integers(0, height - h + 1)
            return int(left), int(top), int(left + w), int(top + h)
    aspect = min(max(width / height, RATIO[0]), RATIO[1])
    w, h = (width, round(width / aspect)) if width / height < aspect else \
        (round(height * aspect), height)
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
"""Decoding threads: Pillow releases the GIL while it decodes and resizes."""


class ImageExamples:
    """A split's images as the ``pixels(rows, epoch, augment)`` of ``arrays.ArrayBatches``:
    float32 [len(rows), height, width(, channels)] (module doc), decoded in threads."""

    def __init__(self, paths: tuple[str, ...], proc: Processor, seed: int,
                 index: np.ndarray | None = None):
        self.paths, self.proc, self.seed = paths, proc, seed
        self.index = np.arange(len(paths)) if index is None else index
        self.shape = (len(self.index), *proc.size, *((proc.channels,) * (proc.channels > 1)))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, rows) -> ImageExamples:
        return ImageExamples(self.paths, self.proc, self.seed, self.index[rows])

    def _one(self, i: int, epoch: int, augment: bool) -> np.ndarray:
        im = decode(self.paths[i], self.proc.channels)
        height, width = self.proc.size
        box = (0, 0, im.width, im.height)
        flip = False
        if augment:
            rng = np.random.default_rng((self.seed, epoch, i))
            box, flip = crop_box(rng, im.width, im.height), rng.random() < 0.5
        x = np.asarray(im.resize((width, height), self.proc.resample, box=box))
        return x[:, ::-1] if flip else x

    def pixels(self, rows, epoch: int, augment: bool) -> np.ndarray:
        jobs = [_POOL.submit(self._one, int(self.index[r]), epoch, augment) for r in rows]
        return self.proc.normalise(np.stack([j.result() for j in jobs]))

    def check(self) -> None:
        """Decode every image once; one ``DataError`` naming each that cannot be read."""
        bad = [e for e in _POOL.map(self._refusal, self.index) if e]
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise DataError(f"{len(bad)} image(s) cannot be read: " + "; ".join(bad[:5]) + more)

    def _refusal(self, i: int) -> str:
        try:
            decode(self.paths[i], self.proc.channels)
        except DataError as e:
            return str(e)
        return ""


_CHECKED: set = set()


@dataclasses.dataclass(frozen=True)
class ImageArrays:
    """The ``ArrayReader`` of ``data.name=images``: each split's (path, class) pairs."""

    files: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
    names: tuple[str, ...]
    proc: Processor
    seed: int

    def examples(self, split: str) -> tuple[ImageExamples, np.ndarray]:
        pairs = dict(self.files)[split]
        labels = []
        for path, name in pairs:
            if name not in self.names:
                raise DataError(f"{path}: its class {name!r} is not among the training "
                                f"classes ({', '.join(self.names)}).")
            labels.append(self.names.index(name))
        x = ImageExamples(tuple(p for p, _ in pairs), self.proc, self.seed)
        if x.paths not in _CHECKED:
            x.check()
            _CHECKED.add(x.paths)
        return x, np.asarray(labels, np.int32)

    def run_files(self) -> dict:
        """The files a trained run keeps beside its checkpoints, so that its eval, predict and
        export read images as it did: ``{PROCESSOR_FILE: the Processor's config}``."""
        return {PROCESSOR_FILE: self.proc.to_config()}

    def features(self, paths: list[str]) -> list:
        """Per path, ``(pixels, {})`` as eval makes them, or the ``DataError`` refusing it."""
        out = []
        for path in paths:
            try:
                out.append((ImageExamples((path,), self.proc, 0).pixels([0], 0, False)[0], {}))
            except DataError as e:
                out.append(e)
        return out


def _image_files(folder: str) -> list[str]:
    """The files under ``folder`` (hidden ones skipped), sorted; ``DataError`` for one that is
    not JPEG, PNG or WebP by its extension."""
    found = sorted(filesplits.search(folder))     # links followed, each real folder once
    for path in found:
        if not path.lower().endswith(EXTENSIONS):
            raise DataError(f"{path}: {os.path.splitext(path)[1] or 'no extension'} is not an "
                            "image format read here (JPEG, PNG, WebP: .jpg .jpeg .png .webp); "
                            "convert it, or move it out of the class folders.")
    return found


def _folder(root: str, key: str) -> list[tuple[str, str]]:
    """(path, class) of every image under the class sub-folders of ``root``."""
    entries = sorted(e for e in os.listdir(root) if not e.startswith("."))
    loose = [e for e in entries if not os.path.isdir(os.path.join(root, e))]
    if loose:
        raise DataError(f"{key}={root!r}: {os.path.join(root, loose[0])} is not in a class "
                        "folder; put each image in a sub-folder named after its class.")
    if not entries:
        raise DataError(f"{key}={root!r} has no class sub-folders; put each image in a "
                        "sub-folder named after its class.")
    pairs = []
    for name in entries:
        found = _image_files(os.path.join(root, name))
        if not found:
            raise DataError(f"{key}={root!r}: the class folder {os.path.join(root, name)!r} "
                            "holds no image; add its images or remove the folder.")
        pairs += [(p, name) for p in found]
    return pairs


def _listing(path: str, label_field: str, key: str) -> list[tuple[str, str]]:
    """(path, class) of each record of a CSV or JSONL listing (fields ``path`` and
    ``label_field``); relative paths are the listing folder's."""
    with open(path, newline="") as f:
        records = list(csv.DictReader(f)) if path.lower().endswith(".csv") else \
            [json.loads(line) for line in f if line.strip()]
    base, pairs = os.path.dirname(os.path.abspath(path)), []
    for n, r in enumerate(records, 1):
        if "path" not in r or label_field not in r:
            raise DataError(f"{path}: record {n} has no 'path' or {label_field!r} field "
                            f"(data.label_field); each record names an image and its label.")
        image = os.path.join(base, os.path.expanduser(str(r["path"])))
        if not os.path.isfile(image):
            raise DataError(f"{path}: record {n}: {image} is not a file.")
        if not image.lower().endswith(EXTENSIONS):
            raise DataError(f"{path}: record {n}: {image} is not JPEG, PNG or WebP by its "
                            "extension (.jpg .jpeg .png .webp); convert it.")
        pairs.append((image, str(r[label_field])))
    if not pairs:
        raise DataError(f"{key}={path!r} lists no image.")
    return pairs


def _pairs(where: str, settings, key: str) -> tuple[tuple[str, str], ...]:
    where = os.path.expanduser(where.strip())
    if os.path.isdir(where):
        return tuple(_folder(where, key))
    if os.path.isfile(where) and where.lower().endswith(LISTINGS):
        return tuple(_listing(where, settings.label_field, key))
    if os.path.exists(where):
        raise DataError(f"{key}={where!r}: expected a folder of class sub-folders, or a "
                        ".csv/.jsonl listing of path and label.")
    raise DataMissing(f"{key}={where!r} does not exist (from {os.getcwd()}); give a folder "
                      "of class sub-folders of images, or a .csv/.jsonl listing.")


def describe(settings, model, batching) -> DataSpec:
    """``data.name=images`` (module doc): the images found and their classes named here."""
    if not settings.train_files:
        raise DataMissing("data.name=images needs data.train_files: a folder of class "
                          "sub-folders of images, or a .csv/.jsonl listing of path and label.")
    if model.shape is None or model.task != "classification":
        raise DataError(f"data.name=images classifies images with a ViT; the model "
                        f"(model.name={model.name!r}) trains {model.task}.")
    files = {"train": _pairs(settings.train_files, settings, "data.train_files")}
    if settings.eval_files:
        files[settings.eval_split] = _pairs(settings.eval_files, settings, "data.eval_files")
    filesplits.refuse_shared({split: [p for p, _ in pairs] for split, pairs in files.items()},
                             settings, examples_are_files=True)
    names = tuple(sorted({name for _, name in files["train"]}))
    if len(names) < 2:
        raise DataError(f"data.train_files={settings.train_files!r}: every image is of the "
                        f"class {names[0]!r}; a classifier needs two classes or more.")
    reader = ImageArrays(tuple(files.items()), names, processor(model.processor or "",
                                                                model.shape), batching.seed)
    counts = {s: len(p) for s, p in files.items()}
    return DataSpec("images", "arrays", reader, settings, batching, model, tuple(files), counts,
                    "the number of images", names, labels_are_ids=True)


__all__ = ["ImageArrays", "ImageExamples", "Processor", "crop_box", "decode", "describe",
           "processor"]
