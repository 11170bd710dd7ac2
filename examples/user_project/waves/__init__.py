"""A user's own project, trained by runlab without touching framework/: its Dataset (data.py), its
model (model.py) and its loss (loss.py), selected by the YAML files in ../conf. From the runlab
checkout:

    PYTHONPATH=examples/user_project python run.py --config-dir examples/user_project/conf experiment=waves

The task: from 64 noisy samples of a sine wave, predict its frequency and amplitude.
"""
