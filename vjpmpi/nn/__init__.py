"""Equinox layers for distributed models on vjpmpi's collectives."""

from ._attention import ParallelMultiheadAttention as ParallelMultiheadAttention
from ._embedding import VocabParallelEmbedding as VocabParallelEmbedding
from ._linear import ColumnParallelLinear as ColumnParallelLinear
from ._linear import RowParallelLinear as RowParallelLinear
from ._mlp import ParallelMLP as ParallelMLP
from ._moe import ExpertParallelMoE as ExpertParallelMoE
from ._mlp import allreduce_gradients as allreduce_gradients
from ._mlp import sync_gradients as sync_gradients
from ._halo import HaloConv as HaloConv
from ._halo import HaloExchange as HaloExchange
from ._loss import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from ._optim import sharded_optimizer as sharded_optimizer
from ._sequence import gather_sequence as gather_sequence
from ._sequence import scatter_sequence_sum as scatter_sequence_sum
from ._sequence import replicated as replicated
from ._pipeline import Schedule as Schedule
from ._pipeline import Slot as Slot
from ._pipeline import from_orders as from_orders
from ._pipeline import gpipe as gpipe
from ._pipeline import one_f_one_b as one_f_one_b
from ._pipeline import pipeline_value_and_grad as pipeline_value_and_grad
