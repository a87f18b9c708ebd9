"""MobileNetV1 (Hugging Face transformers, "TensorFlow" padding, ReLU6) at ImageNet size."""
import torch
from transformers import MobileNetV1Config, MobileNetV1ForImageClassification


def factory(batch: int = 64):
    config = MobileNetV1Config(num_labels=1000)
    model = MobileNetV1ForImageClassification(config)
    pixels = torch.randn(batch, 3, 224, 224)
    labels = torch.randint(0, 1000, (batch,))
    return model, {"pixel_values": pixels, "labels": labels}
