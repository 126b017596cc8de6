"""Writes the HF dataset folders under tests/assets/ with the real `datasets` package (5.2.0).

    pip install datasets   # in a scratch venv: the project reads these folders with pyarrow only
    python tests/assets/make_hf_datasets.py

`math_dataset/` is a `Dataset.save_to_disk` folder in two shards (state.json, dataset_info.json,
data-0000i-of-00002.arrow); `math_dict/` is a `DatasetDict` (dataset_dict.json, train/, test/).
"""

import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = {
    "question": ["What is 1+1?", "What is 2+3?", "Name both roots of x^2=1.", "What is 10/4?"],
    "final_answer": [["2"], ["5"], ["1", "-1"], ["\\frac{5}{2}"]],
    "meta": [{"gt": "2"}, {"gt": "5"}, {"gt": "\\pm 1"}, {"gt": "2.5"}],
    "idx": [10, 11, 12, 13],
}

if __name__ == "__main__":
    ds = datasets.Dataset.from_dict(ROWS)
    ds.save_to_disk(os.path.join(HERE, "math_dataset"), num_shards=2)
    datasets.DatasetDict({"train": ds.select(range(3)), "test": ds.select([3])}).save_to_disk(
        os.path.join(HERE, "math_dict"))
