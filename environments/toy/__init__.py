"""Small environments for tests, examples and the trainers' learning tests."""

from environments.toy.digits import DigitsEnv
from environments.toy.grid import GridWalkEnv
from environments.toy.guess import GuessNumberEnv
from environments.toy.reverse import ReverseEnv

__all__ = ["DigitsEnv", "GridWalkEnv", "GuessNumberEnv", "ReverseEnv"]
