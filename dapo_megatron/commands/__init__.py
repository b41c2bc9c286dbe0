"""The command-line tools installed as console scripts (`dapo-eval`, `dapo-prepare-data`, ...; see
pyproject.toml). Each module's `main(argv)` returns the exit status; tools/*.py run the same ones from a
checkout."""
