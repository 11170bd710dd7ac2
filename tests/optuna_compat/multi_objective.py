"""Two objectives of x and y to minimize together (Binh and Korn's problem), for the
multi-objective scenarios of tests/test_optuna_compat.py."""
from typing import Tuple

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="multi_objective_conf", config_name="config")
def binh_and_korn(cfg: DictConfig) -> Tuple[float, float]:
    return 4 * cfg.x ** 2 + 4 * cfg.y ** 2, (cfg.x - 5) ** 2 + (cfg.y - 5) ** 2


if __name__ == "__main__":
    binh_and_korn()
