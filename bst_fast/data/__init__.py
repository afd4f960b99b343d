"""Data for bst_fast: star graphs G(d, l) with path-accuracy evaluation, and BPE text corpora."""
from .star import (StarGraph, StarGraphData, StarGraphStream, StarGraphTokenizer, StarLayout,
                   generate_star_graphs, graph_keys, path_accuracy, sample_star_graphs)
from .text import TextData, load_ids, load_tokenizer, save_tokenizer, train_bpe

__all__ = [
    "StarGraph", "StarGraphTokenizer", "StarLayout", "StarGraphData", "StarGraphStream",
    "sample_star_graphs", "generate_star_graphs", "graph_keys", "path_accuracy",
    "train_bpe", "save_tokenizer", "load_tokenizer", "load_ids", "TextData",
]
