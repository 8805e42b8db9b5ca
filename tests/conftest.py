"""Shared test set-up: quiet TensorFlow, and a fresh TF1 graph per test that asks for one."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
