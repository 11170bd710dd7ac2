"""A Hydra app outside runlab for hydra-optuna-sweeper's scenarios (tests/test_optuna_compat.py):
the sphere function of x and y, to minimize; error=true makes every job fail."""
import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="conf", config_name="config")
def sphere(cfg: DictConfig) -> float:
    if cfg.get("error", False):
        raise RuntimeError("cfg.error is True")
    return cfg.x ** 2 + cfg.y ** 2


if __name__ == "__main__":
    sphere()
