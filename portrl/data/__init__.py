"""Datasets: preprocessing to verl-schema parquet, the RL prompt dataset, the SFT dataset."""

from portrl.data.arith import make_arith_rows, make_arith_sft_rows
from portrl.data.preprocess import preprocess, read_records, write_split
from portrl.data.rl_dataset import PromptBatch, RLDataset, left_pad
from portrl.data.schema import GSM8K_INSTRUCTION, MATH_INSTRUCTION, DataError, make_row
from portrl.data.sft_dataset import SFTBatch, SFTDataset, SFTExample

__all__ = [
    "GSM8K_INSTRUCTION", "MATH_INSTRUCTION", "DataError", "PromptBatch", "RLDataset", "SFTBatch", "SFTDataset",
    "SFTExample", "left_pad", "make_arith_rows", "make_arith_sft_rows", "make_row", "preprocess", "read_records",
    "write_split",
]
