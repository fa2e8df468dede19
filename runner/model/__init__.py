"""The model a run steps: what it is (``model.family``, families.py: classifier, segmenter,
detector, each a record saying what it learns and how it trains), which network (``model=``,
networks.py: torchvision's, timm's, your own, behind the uint8 input layer that normalizes;
detectors.py: torchvision's detectors and the user's own), in what precision (``amp=``,
amp.py), in what compiled form (``compile=``, compile.py: eager, torch.compile, TorchScript,
TensorRT, onnxruntime) and its ONNX export (onnx.py, which ``compile=onnxruntime`` runs and
``python -m runner.export`` writes). It builds on the config and the data path's
normalization; nothing here imports the loop, a task or the run.
"""
