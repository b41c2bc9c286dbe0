"""The model architectures an engine this project launches can resolve without SGLang's full registry.

SGLang finds a model's class by importing every module in `sglang.srt.models` (268 classes, ~3 s of one
core on a CPU engine, all before the first request) unless `SGLANG_EXTERNAL_MODEL_PACKAGE` names a package
whose modules export `EntryClass`: then it looks there first and imports its own registry only for an
architecture the package lacks. `rollout/engine.py` names this package, which exports SGLang's own class
for the architecture this project trains (Qwen2, for the Qwen2.5 family), so nothing about the model
changes, only how SGLang finds it; any other architecture still resolves through SGLang's registry.

Importing this package loads nothing; SGLang imports its modules in the engine's scheduler."""
