"""Named test doubles (fake servers) shared by the test suites."""
