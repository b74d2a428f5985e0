"""The paper's network."""
from torch import nn


def paper_mlp(in_features: int = 784, width: int = 10, layers: int = 5, classes: int = 10) -> nn.Sequential:
    """The paper's ReLU MLP: ``layers`` linear layers of ``width`` units, the last one the logits.

    784-10-10-10-10-10 on MNIST (8,290 parameters); 64-10-10-10-10-10 on the 8x8 digits (1,090).
    """
    modules, fan_in = [], in_features
    for i in range(layers):
        out = classes if i == layers - 1 else width
        modules.append(nn.Linear(fan_in, out))
        if i < layers - 1:
            modules.append(nn.ReLU())
        fan_in = out
    return nn.Sequential(*modules)
