"""Data for bst_fast: star graphs G(d, l) with path-accuracy evaluation, BPE text corpora, and
pre-tokenised (prepared) corpora and their weighted mixtures."""
from .star import (StarGraph, StarGraphData, StarGraphStream, StarGraphTokenizer, StarLayout,
                   generate_star_graphs, graph_keys, path_accuracy, sample_star_graphs)
from .text import TextData, load_ids, load_tokenizer, save_tokenizer, train_bpe
from .prepared import MixtureData, PreparedCorpus, tokenize_corpus

__all__ = [
    "StarGraph", "StarGraphTokenizer", "StarLayout", "StarGraphData", "StarGraphStream",
    "sample_star_graphs", "generate_star_graphs", "graph_keys", "path_accuracy",
    "train_bpe", "save_tokenizer", "load_tokenizer", "load_ids", "TextData",
    "tokenize_corpus", "PreparedCorpus", "MixtureData",
]
