"""What the tests share: fixtures (a local cluster, sshd, the app on fixed states),
harnesses (a ring of real Stages in one process) and generated models. Not tests."""
