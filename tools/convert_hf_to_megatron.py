#!/usr/bin/env python
"""Convert a Hugging Face Qwen2 checkpoint into a megatron-core torch_dist checkpoint.

Runs `dapo-convert-hf-to-megatron` (dapo_megatron/commands/convert_hf_to_megatron.py, where its options are
documented), so that `python tools/convert_hf_to_megatron.py ...` keeps working from a checkout.
"""

import sys

from dapo_megatron.commands.convert_hf_to_megatron import main

if __name__ == "__main__":
    sys.exit(main())
