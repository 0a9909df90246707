"""Test helpers for dclens: tiny random checkpoints in the published layouts.

`make_tiny.make_tiny(out_dir, ...)` writes a small DCPythia or Pythia (GPT-NeoX)
checkpoint directory (config.json + safetensors or PyTorch-zip weights, optionally
sharded) and returns the state dict it wrote (widened to float32) and its config.
The module is self-contained (numpy and, for safetensors, the `safetensors`
package; never torch) and can also be run as a script:

    python -m dclens.testing.make_tiny OUT_DIR --type dcpythia --dtype float16 --format torch --shards 2
"""
