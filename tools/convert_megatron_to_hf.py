#!/usr/bin/env python
"""Convert a megatron-core torch_dist checkpoint (any TP x PP layout it was saved from) into a
Hugging Face Qwen2 directory that `transformers` loads.

Runs `dapo-convert-megatron-to-hf` (dapo_megatron/commands/convert_megatron_to_hf.py, where its options are
documented), so that `python tools/convert_megatron_to_hf.py ...` keeps working from a checkout.
"""

import sys

from dapo_megatron.commands.convert_megatron_to_hf import main

if __name__ == "__main__":
    sys.exit(main())
