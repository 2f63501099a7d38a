"""Equinox layers for distributed models on vjpmpi's collectives."""

from ._embedding import VocabParallelEmbedding as VocabParallelEmbedding
from ._linear import ColumnParallelLinear as ColumnParallelLinear
from ._linear import RowParallelLinear as RowParallelLinear
from ._mlp import ParallelMLP as ParallelMLP
from ._mlp import allreduce_gradients as allreduce_gradients
