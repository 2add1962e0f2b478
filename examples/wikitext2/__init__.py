"""The ONNX Runtime training notebook's WikiText-2 Transformer language model, ported to ort_trainer."""
