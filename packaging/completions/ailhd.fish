# Print an optspec for argparse to handle cmd's options that are independent of any subcommand.
function __fish_ailhd_global_optspecs
    string join \n config= verbose debug h/help V/version
end

function __fish_ailhd_needs_command
    # Figure out if the current invocation already has a command.
    set -l cmd (commandline -opc)
    set -e cmd[1]
    argparse -s (__fish_ailhd_global_optspecs) -- $cmd 2>/dev/null
    or return
    if set -q argv[1]
        # Also print the command, so this can be used to figure out what it is.
        echo $argv[1]
        return 1
    end
    return 0
end

function __fish_ailhd_using_subcommand
    set -l cmd (__fish_ailhd_needs_command)
    test -z "$cmd"
    and return 1
    contains -- $cmd[1] $argv
end

complete -c ailhd -n "__fish_ailhd_needs_command" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_needs_command" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_needs_command" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_needs_command" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_needs_command" -s V -l version -d 'Print version'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "run" -d 'The ingestion service (what systemd starts): watch the tree, ingest new or changed recordings'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "rebuild" -d 'Regenerate every output from the tree; the old outputs stay until the new ones are complete'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "merge" -d 'One set of outputs over several (shards, or several hosts) without copying features: HDF5 virtual datasets; one valid row per content (over the shards of one tree, the smallest path\'s, as one rebuild; between other outputs, the first input keeps it)'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "status" -d 'Files per state, rows per split and label, quarantined files with reasons'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "check-config" -d 'Validate the configuration and what the service needs at start (exit 0, or 2 with the reason)'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "compact" -d 'Copy the manifest\'s records into a fresh manifest that takes its place, in about 40% of the space one written by `rebuild` or the service takes. For a stopped service (it holds the state folder while it runs)'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "reload" -d 'Make the running service reload its configuration and wait for its answer (systemd\'s ExecReload): exit 0 when accepted, 2 when refused'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "inspect" -d 'Decode and featurise one recording; print a summary, optionally a picture'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "demo" -d 'Make a small synthetic labelled tree, build it, show the result'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "doctor" -d 'What this host offers (CPU features, CUDA driver and GPU, NVRTC) and a CPU/GPU parity self-test'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "completions" -d 'Print the shell\'s completion script (the Debian package installs those of bash, zsh and fish); e.g. `ailhd completions bash > ~/.local/share/bash-completion/completions/ailhd`'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "man" -d 'Write the man pages (ailhd.1, ailhd-COMMAND.1: roff) into DIR, as the Debian package installs them'
complete -c ailhd -n "__fish_ailhd_needs_command" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c ailhd -n "__fish_ailhd_using_subcommand run" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand run" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand run" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand run" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand rebuild" -l device -d 'Where to featurise (default: ingest.device from the configuration)' -r -f -a "auto\t''
cpu\t''
cuda\t''"
complete -c ailhd -n "__fish_ailhd_using_subcommand rebuild" -l shard -d 'Only the recordings of shard I of N (by a hash of the path, I from 0; each shard reads only its own files), for a scheduler\'s array job; `auto` or `auto/N` take I (and N) from SLURM_ARRAY_TASK_ID/_COUNT or JOB_COMPLETION_INDEX' -r
complete -c ailhd -n "__fish_ailhd_using_subcommand rebuild" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand rebuild" -l json -d 'Print the report as JSON (docs/json.md)'
complete -c ailhd -n "__fish_ailhd_using_subcommand rebuild" -l allow-empty -d 'Empty the outputs when the recordings folder holds nothing (refused without it while the outputs hold recordings: the disk may not be mounted)'
complete -c ailhd -n "__fish_ailhd_using_subcommand rebuild" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand rebuild" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand rebuild" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand merge" -l into -d 'Folder for the merged files (empty, or a previous merge)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand merge" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand merge" -l npy -d 'Also write npy/<split>/ columns: COPIES of the merged rows'
complete -c ailhd -n "__fish_ailhd_using_subcommand merge" -l json -d 'Print the report as JSON'
complete -c ailhd -n "__fish_ailhd_using_subcommand merge" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand merge" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand merge" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand status" -l png -d 'Also draw the dataset (rows per label and split, arrivals, gains) as a PNG' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand status" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand status" -l json -d 'Print the report as JSON (docs/json.md)'
complete -c ailhd -n "__fish_ailhd_using_subcommand status" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand status" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand status" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand check-config" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand check-config" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand check-config" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand check-config" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand compact" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand compact" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand compact" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand compact" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand reload" -l pid -d 'The service\'s pid as systemd knows it ($MAINPID); checked against the lock holder' -r
complete -c ailhd -n "__fish_ailhd_using_subcommand reload" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand reload" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand reload" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand reload" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand inspect" -l png -d 'Also draw the recording (waveform, spectrogram, stored features) as a PNG' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand inspect" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand inspect" -l json -d 'Print the summary as JSON (docs/json.md)'
complete -c ailhd -n "__fish_ailhd_using_subcommand inspect" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand inspect" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand inspect" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand demo" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand demo" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand demo" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand demo" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand doctor" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand doctor" -l json -d 'Print the findings as JSON (docs/json.md)'
complete -c ailhd -n "__fish_ailhd_using_subcommand doctor" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand doctor" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand doctor" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand completions" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand completions" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand completions" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand completions" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand man" -l config -d 'Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults)' -r -F
complete -c ailhd -n "__fish_ailhd_using_subcommand man" -l verbose -d 'Say more (info messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand man" -l debug -d 'Say everything (debug messages)'
complete -c ailhd -n "__fish_ailhd_using_subcommand man" -s h -l help -d 'Print help'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "run" -d 'The ingestion service (what systemd starts): watch the tree, ingest new or changed recordings'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "rebuild" -d 'Regenerate every output from the tree; the old outputs stay until the new ones are complete'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "merge" -d 'One set of outputs over several (shards, or several hosts) without copying features: HDF5 virtual datasets; one valid row per content (over the shards of one tree, the smallest path\'s, as one rebuild; between other outputs, the first input keeps it)'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "status" -d 'Files per state, rows per split and label, quarantined files with reasons'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "check-config" -d 'Validate the configuration and what the service needs at start (exit 0, or 2 with the reason)'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "compact" -d 'Copy the manifest\'s records into a fresh manifest that takes its place, in about 40% of the space one written by `rebuild` or the service takes. For a stopped service (it holds the state folder while it runs)'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "reload" -d 'Make the running service reload its configuration and wait for its answer (systemd\'s ExecReload): exit 0 when accepted, 2 when refused'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "inspect" -d 'Decode and featurise one recording; print a summary, optionally a picture'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "demo" -d 'Make a small synthetic labelled tree, build it, show the result'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "doctor" -d 'What this host offers (CPU features, CUDA driver and GPU, NVRTC) and a CPU/GPU parity self-test'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "completions" -d 'Print the shell\'s completion script (the Debian package installs those of bash, zsh and fish); e.g. `ailhd completions bash > ~/.local/share/bash-completion/completions/ailhd`'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "man" -d 'Write the man pages (ailhd.1, ailhd-COMMAND.1: roff) into DIR, as the Debian package installs them'
complete -c ailhd -n "__fish_ailhd_using_subcommand help; and not __fish_seen_subcommand_from run rebuild merge status check-config compact reload inspect demo doctor completions man help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
