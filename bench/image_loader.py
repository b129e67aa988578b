"""The images loader against the ViT step (issue 60): images/s decoded, random-resized-cropped,
flipped and normalised by ``data.name=images`` (threads, ``data.images.ImageExamples``) on this
machine, against the images/s the ViT classifier's train step consumes on the same batches.

    python bench/image_loader.py [--images 256] [--model vit-b16-mae] [--batch 32] [--out DIR]

The images: ``--images`` JPEGs of 500 x 375 (ImageNet's typical size; smooth colour fields
and noise, quality 90) in two class folders, written to a temporary folder. The loader: the
trainer's own training batches (``Run.train_data.batches``), timed over every batch of an
epoch after one warm-up batch. The step: ``Run.train_step`` on those batches, 5 warm-up steps
and ``--steps`` timed (random init; a checkpoint's weights take the same time).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def write_jpegs(root: str, n: int, seed: int = 0) -> None:
    from PIL import Image
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:375, 0:500] / 500.0
    for i in range(n):
        folder = os.path.join(root, ("a", "b")[i % 2])
        os.makedirs(folder, exist_ok=True)
        field = np.stack([np.sin(xx * rng.uniform(1, 9) + yy * rng.uniform(1, 9) + c)
                          for c in range(3)], -1)
        x = np.clip(127 + 90 * field + rng.normal(0, 12, field.shape), 0, 255).astype(np.uint8)
        Image.fromarray(x).save(os.path.join(folder, f"{i}.jpg"), quality=90)


def measure(root: str, model: str, batch: int, steps: int) -> dict:
    from jaxaccel import config
    from jaxaccel.train.run import assemble, resolve
    cfg = config.build(sets=[f"model.name={model}", "model.task=classification",
                             "model.num_labels=2", "data.name=images",
                             f"data.train_files={root}", "data.holdout=0.1",
                             f"train.batch_size={batch}", f"train.eval_batch_size={batch}",
                             "train.max_steps=1000", f"workdir={root}/runs"])
    run = assemble(resolve(cfg))
    data = run.train_data
    it = data.batches(0)
    next(it)                                       # threads started, first decode
    t0 = time.perf_counter()
    made = sum(len(b["labels"]) for b in it)
    loader = made / (time.perf_counter() - t0)
    batches = [run.put_batch(b) for _, b in zip(range(steps + 5), data.batches(1))]
    while len(batches) < steps + 5:
        batches += batches[:steps + 5 - len(batches)]
    step_s = common.seconds_per_step(run, batches)
    return {"loader_images_per_s": loader, "step_images_per_s": batch / step_s,
            "step_s": step_s, "loader_over_step": loader * step_s / batch,
            "threads": os.cpu_count()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--model", default="vit-b16-mae", help="a ViT preset (224 x 224 RGB)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    common.add_out_argument(p)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jaxaccel-images-") as root:
        write_jpegs(root, args.images)
        r = measure(root, args.model, args.batch, args.steps)
    row = {"name": f"{args.model} b{args.batch}: loader vs train step", "median_s": r["step_s"],
           "min_s": r["step_s"], "max_s": r["step_s"], "n": args.steps, **r}
    print(common.markdown([row], ["name", "loader_images_per_s", "step_images_per_s",
                                  "loader_over_step", "threads"]))
    print(common.write_results("image_loader", [row], out=args.out))


if __name__ == "__main__":
    main()
