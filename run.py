"""runlab's single entrypoint: `python run.py [group=option ...] [key=value ...]`.

Everything lives in framework/; this file only hands Hydra's composed config to it.
"""
import hydra

import framework


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    return framework.main(cfg)


if __name__ == "__main__":
    framework.cli(main)
