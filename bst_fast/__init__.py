"""bst_fast: the Belief State Transformer's all-pairs objective, fused on CPU (C++) and GPU (Triton).

    import bst_fast
    metrics = bst_fast.train("configs/star_cpu.yaml", steps=500, out_dir="runs/mine")

`train(config=None, **overrides)` trains a model (config: a TrainConfig, a dict or a YAML/JSON
path; overrides: the config's field names, `model={...}` or dotted keys like "model.n_layer").
The loss (`belief_state_loss`, `BeliefStateLoss`, the heads `TextHead` and `ResidualSwiGLUHead`),
the models and their configs, the decoding entry points and the data classes are exported here;
everything else is private.
"""
__version__ = "0.1.0"

from .data import (StarGraphData, StarGraphStream, StarGraphTokenizer, TextData, load_tokenizer,
                   path_accuracy, train_bpe)
from .decode import Plan, beam_search, plan, sample
from .head import ResidualSwiGLUHead, TextHead
from .loss import BACKENDS, BeliefStateLoss, belief_state_loss, separated_documents
# The C++ ops load with the package (through _pairs): their autograd and fake rules attach now too,
# so that a raw torch.ops.bst_fast.pair_loss call differentiates and compiles whatever ran first
from .backends import cpp_backend as _cpp_backend  # noqa: F401
from .model import BeliefStateTransformer, ForwardOnly, ModelConfig
from .checkpoint import load_model
from .config import TrainConfig
from .trainer import TrainingStopped, train

__all__ = [
    # the loss
    "TextHead", "ResidualSwiGLUHead", "belief_state_loss", "BeliefStateLoss", "BACKENDS",
    "separated_documents",
    # training
    "train", "TrainConfig", "ModelConfig", "BeliefStateTransformer", "ForwardOnly", "TrainingStopped",
    "load_model",
    # decoding: sampling (greedy, top-k, temperature), Algorithm 1 planning, beam search
    "sample", "plan", "Plan", "beam_search",
    # data
    "StarGraphTokenizer", "StarGraphData", "StarGraphStream", "path_accuracy",
    "TextData", "train_bpe", "load_tokenizer",
]
