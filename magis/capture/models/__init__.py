"""Model definitions written for the workload zoo and the corpus (the rest come from Hugging Face transformers)."""

from magis.capture.models.btlm import BTLM, BTLMConfig, alibi_slopes
from magis.capture.models.densenet import DenseNet, DenseNetConfig
from magis.capture.models.gcn import GCN, GCNConfig
from magis.capture.models.rnn_lm import RecurrentLM, RecurrentLMConfig
from magis.capture.models.unet import UNet
from magis.capture.models.unetpp import UNetPlusPlus

__all__ = [
    "BTLM",
    "BTLMConfig",
    "DenseNet",
    "DenseNetConfig",
    "GCN",
    "GCNConfig",
    "RecurrentLM",
    "RecurrentLMConfig",
    "UNet",
    "UNetPlusPlus",
    "alibi_slopes",
]
