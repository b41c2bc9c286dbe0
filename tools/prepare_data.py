#!/usr/bin/env python
"""Download the public DAPO data sets and write them as de-duplicated local files the trainer reads.

Runs `dapo-prepare-data` (dapo_megatron/commands/prepare_data.py, where its options are documented), so that
`python tools/prepare_data.py ...` keeps working from a checkout.
"""

import sys

from dapo_megatron.commands.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
