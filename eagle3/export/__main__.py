"""python -m eagle3.export: the export stage's command line (eagle3.export.stage.main)."""

from eagle3.export.stage import main

if __name__ == "__main__":
    main()
