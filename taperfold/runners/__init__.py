"""One runner per backend (torch, ONNX Runtime, TensorRT) behind one interface, as Polygraphy does.
Runners only load and run; timing statistics and numeric comparison live in bench/ and verify."""
