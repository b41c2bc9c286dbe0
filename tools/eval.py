#!/usr/bin/env python
"""Evaluate a policy with the rollout engine: k samples per problem, avg@k and pass@k.

Runs `dapo-eval` (dapo_megatron/commands/eval.py, where its options are documented), so that `python
tools/eval.py ...` keeps working from a checkout.
"""

import sys

from dapo_megatron.commands.eval import main

if __name__ == "__main__":
    sys.exit(main())
