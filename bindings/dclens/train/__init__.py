"""Training small DCPythia / Pythia models on the CPU with the engine's
backward (loop) and the record of a run (run_record).

    from dclens.train import TrainConfig, train

The names of dclens.train before the subpackages are loop's."""

from .loop import (
    BUCKET_ROUND,
    BUCKET_STEPS,
    HELP,
    AdamW,
    TrainConfig,
    batch,
    build_parser,
    init_weights,
    lr_at,
    main,
    model_config,
    read_weights,
    to_layout,
    train,
    train_step,
    write_model,
    write_safetensors,
)

__all__ = [
    "AdamW",
    "BUCKET_ROUND",
    "BUCKET_STEPS",
    "HELP",
    "TrainConfig",
    "batch",
    "build_parser",
    "init_weights",
    "lr_at",
    "main",
    "model_config",
    "read_weights",
    "to_layout",
    "train",
    "train_step",
    "write_model",
    "write_safetensors",
]
