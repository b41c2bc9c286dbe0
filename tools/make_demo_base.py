#!/usr/bin/env python
"""Build the laptop demo's base policy: a tiny Qwen2 taught the `Answer: N` format, in Hugging Face format.

    python tools/make_demo_base.py --output outputs/demo_base [--force] [hydra overrides]

DAPO starts from a pretrained base model; the demo has none, so this trains one from scratch with a
supervised warm-up on the arithmetic task (real megatron-core), stopping as soon as held-out greedy
accuracy reaches `warmup.target_accuracy` (default 0.22, inside the steep rise that follows learning the
format): the format is learned, the arithmetic mostly not, which leaves RL something to teach. The result
is an ordinary HF directory (config.json, safetensors, the character tokenizer, warmup_summary.json) that
the trainer loads through the same HF -> Megatron mapping as Qwen2.5. Same seed and overrides, same base, on
the same software versions. With `model.hf_dir=<an earlier base>` (and its model and task overrides) the
warm-up continues that base.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from dapo_megatron import config as job_config
from dapo_megatron.models.hf_io import prepare_output_dir
from dapo_megatron.trainer import warmup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", required=True, help="HF directory to create")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --output")
    args, overrides = parser.parse_known_args(argv)
    # The base this warm-up continues, however it was set (an override or a config such as experiment=demo),
    # before --force empties the output.
    continued = job_config.to_job_config(job_config.compose(overrides)).model.hf_dir
    if continued and Path(continued).resolve() == Path(args.output).resolve():
        parser.error(
            f"--output {args.output} is the base this warm-up continues (model.hf_dir): write the "
            "continued base elsewhere, then replace the old one"
        )
    out = prepare_output_dir(args.output, force=args.force)
    work = out.with_name(out.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    warmup.main([*overrides, f"output_dir={work}"])
    out.rmdir()
    (work / "warmup_hf").rename(out)
    shutil.copytree(work / "tensorboard", out / "tensorboard")
    shutil.rmtree(work)
    print(f"demo base written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
