from parsat.cli import main
from parsat.dsl.lifetime import exit_process

exit_process(main())
