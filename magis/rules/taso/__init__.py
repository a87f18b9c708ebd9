"""TASO-style substitutions that matter in training graphs (thesis ch. 3; MAGIS §5, §7.1),
one module per family, combined as data.

Each rule is checked the TASO way (thesis §3.4): by running the rewritten program on random
inputs and comparing with the original (tests/test_taso.py).
"""

from magis.rules.taso import (
    activation,
    cat,
    conv,
    conv_cat,
    distributivity,
    ignored_input,
    matmul,
    norm_cat,
    pad,
)
from magis.rules.taso.activation import READ_ACTIVATION_OUTPUTS
from magis.rules.taso.cat import FOLD_SLICE_OF_CAT, SPLIT_MATMUL_OF_CAT
from magis.rules.taso.conv import MERGE_CONV_BACKWARD, SPLIT_CONV_BACKWARD
from magis.rules.taso.conv_cat import (
    MERGE_CONV_OUTPUT,
    MERGE_WGRADS_OF_CAT,
    SPLIT_CONV_OUTPUT,
    SPLIT_WGRAD_OF_CAT,
)
from magis.rules.taso.distributivity import EXPAND, FACTOR
from magis.rules.taso.ignored_input import SHRINK_IGNORED_INPUTS
from magis.rules.taso.matmul import MERGE_MATMUL, SPLIT_MATMUL
from magis.rules.taso.norm_cat import SPLIT_BN_BACKWARD_OF_CAT
from magis.rules.taso.pad import FOLD_ZERO_PADS

# The search offers candidates in this order (and a seeded search shuffles this tuple).
TASO_RULES = (*matmul.RULES, *cat.RULES, *distributivity.RULES, *conv.RULES, *conv_cat.RULES)
# Substitutions that joined later (issue 42: CNN activations and DenseNet's concatenations). The catalog lists them after
# every other rule, so that the search's order of the rules before them is unchanged.
LATER_TASO_RULES = (
    *pad.RULES,
    *activation.RULES,
    *norm_cat.RULES,
    *ignored_input.RULES,
    *cat.LATER_RULES,
)

__all__ = [
    "EXPAND",
    "FACTOR",
    "FOLD_SLICE_OF_CAT",
    "FOLD_ZERO_PADS",
    "LATER_TASO_RULES",
    "MERGE_CONV_BACKWARD",
    "MERGE_CONV_OUTPUT",
    "MERGE_MATMUL",
    "MERGE_WGRADS_OF_CAT",
    "READ_ACTIVATION_OUTPUTS",
    "SPLIT_CONV_BACKWARD",
    "SHRINK_IGNORED_INPUTS",
    "SPLIT_BN_BACKWARD_OF_CAT",
    "SPLIT_CONV_OUTPUT",
    "SPLIT_MATMUL",
    "SPLIT_MATMUL_OF_CAT",
    "SPLIT_WGRAD_OF_CAT",
    "TASO_RULES",
]
