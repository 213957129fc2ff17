from kvpool.tools.cli import main

raise SystemExit(main(["master", *__import__("sys").argv[1:]]))
