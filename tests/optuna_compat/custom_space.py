"""custom_search_space: z is drawn near the x the sampler drew, and +w adds a new key; for the
custom-search-space scenario of tests/test_optuna_compat.py."""
import hydra
from omegaconf import DictConfig
from optuna.trial import Trial


@hydra.main(version_base=None, config_path="custom_space_conf", config_name="config")
def sphere_of_four(cfg: DictConfig) -> float:
    return cfg.w ** 2 + cfg.x ** 2 + cfg.y ** 2 + cfg.z ** 2


def configure(cfg: DictConfig, trial: Trial) -> None:
    x = trial.params["x"]
    trial.suggest_float("z", x - cfg.max_z_difference_from_x, x + cfg.max_z_difference_from_x)
    trial.suggest_float("+w", 0.0, 1.0)  # "+": w is not in the config yet


if __name__ == "__main__":
    sphere_of_four()
