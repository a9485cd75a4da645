// Command gpuslice-enforcer-hook is the CDI hook that hands a new container to the gpuslice
// enforcer: the OCI runtime runs it on the host as the createContainer hook (and the poststop
// hook) of a share's containers, with the OCI state on stdin:
//
//	gpuslice-enforcer-hook attach --socket /var/run/gpuslice/enforcer.sock \
//	    --claim-uid <uid> --share-id <id> --timeout 10
//
// It reads /proc/<pid>/cgroup of the container's init process and asks the enforcer, on its
// attach socket (<socket>.attach, after following the --socket link once), to attach the
// container; it exits 0 only once the enforcer says every limit is in force. Any failure exits
// 1 (2 for a bad command line or OCI state) with the reason on stderr, so the runtime fails the
// container instead of starting it unenforced.
//
// It is the Python hook (services/enforcer/src/gpuslice_enforcer/hook.py) as one static binary:
// the same command line, wire protocol (attachwire.py), retries, exit codes and messages, with
// the standard library only and no cgo, so it runs on any Linux host whatever its libc (or
// none). The one difference: it does not speak gRPC, so an enforcer without an attach socket
// (older than the attach socket itself) is waited for like a missing one (docs/enforcer.md).
package main

import (
	"errors"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
)

const (
	exitFailed = 1
	exitUsage  = 2
	usage      = "usage: gpuslice-enforcer-hook {attach,detach} --socket PATH --claim-uid UID " +
		"[--share-id ID] [--timeout SECONDS]"
	prefix = "gpuslice-enforcer-hook: "
)

// args is the hook's command line.
type args struct {
	action   string
	socket   string
	claimUID string
	shareID  string
	timeout  float64
}

// usageError is a bad command line; an empty message asks for the usage (-h, --help).
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// parseArgs reads the command line exactly as the Python hook's Args does, messages included.
func parseArgs(argv []string) (*args, error) {
	a := &args{timeout: 10}
	rest := argv
	for len(rest) > 0 {
		arg := rest[0]
		rest = rest[1:]
		if arg == "-h" || arg == "--help" {
			return nil, &usageError{}
		}
		if !strings.HasPrefix(arg, "--") {
			if a.action != "" {
				return nil, &usageError{"unexpected argument " + pyStr(arg)}
			}
			if arg != "attach" && arg != "detach" {
				return nil, &usageError{"action " + pyStr(arg) + ": choose attach or detach"}
			}
			a.action = arg
			continue
		}
		name, value, equals := strings.Cut(arg, "=")
		switch name {
		case "--socket", "--claim-uid", "--share-id", "--timeout":
		default:
			return nil, &usageError{"unknown option " + name}
		}
		if !equals {
			if len(rest) == 0 {
				return nil, &usageError{name + " needs a value"}
			}
			value = rest[0]
			rest = rest[1:]
		}
		switch name {
		case "--timeout":
			seconds, ok := pyFloat(value)
			if !ok {
				return nil, &usageError{"--timeout " + pyStr(value) + ": not a number of seconds"}
			}
			if !(seconds > 0) {
				return nil, &usageError{"--timeout " + pyStr(value) + ": must be more than 0"}
			}
			a.timeout = seconds
		case "--socket":
			a.socket = value
		case "--claim-uid":
			a.claimUID = value
		case "--share-id":
			a.shareID = value
		}
	}
	if a.action == "" {
		return nil, &usageError{"the action (attach or detach) is required"}
	}
	if a.socket == "" {
		return nil, &usageError{"--socket is required"}
	}
	if a.claimUID == "" {
		return nil, &usageError{"--claim-uid is required"}
	}
	return a, nil
}

// duration is seconds as a time.Duration, capped where the nanoseconds would overflow.
func duration(seconds float64) time.Duration {
	if seconds > 1e9 {
		return time.Duration(1e9) * time.Second
	}
	return time.Duration(seconds * float64(time.Second))
}

// splitLines splits like Python's str.splitlines for the line ends /proc files can hold.
func splitLines(text string) []string {
	var lines []string
	for len(text) > 0 {
		i := strings.IndexAny(text, "\r\n")
		if i < 0 {
			lines = append(lines, text)
			break
		}
		lines = append(lines, text[:i])
		if text[i] == '\r' && i+1 < len(text) && text[i+1] == '\n' {
			i++
		}
		text = text[i+1:]
	}
	return lines
}

func fail(stderr io.Writer, message string, status int) int {
	_, _ = io.WriteString(stderr, prefix+bounded(message, 4*maxText)+"\n")
	return status
}

// run is the whole hook: the command line, the OCI state, the call, the exit status.
func run(argv []string, stdin io.Reader, stdout, stderr io.Writer) int {
	a, err := parseArgs(argv)
	if err != nil {
		if err.Error() == "" {
			_, _ = io.WriteString(stdout, usage+"\n")
			return 0
		}
		return fail(stderr, err.Error()+"\n"+usage, exitUsage)
	}
	deadline := time.Now().Add(duration(a.timeout))
	data, err := io.ReadAll(stdin)
	if err != nil {
		return fail(stderr, "the OCI state could not be read: "+strerror(err), exitUsage)
	}
	containerID, pid, err := readState(data)
	if err != nil {
		return fail(stderr, err.Error(), exitUsage)
	}
	if a.action == "attach" && pid <= 0 {
		return fail(stderr, "the OCI state has no pid to attach", exitUsage)
	}
	var lines []string
	if pid > 0 {
		path := "/proc/" + strconv.FormatInt(pid, 10) + "/cgroup"
		text, err := os.ReadFile(path)
		if err != nil {
			return fail(stderr, path+": "+strerror(err), exitFailed)
		}
		lines = splitLines(string(text))
	}
	method, message := byte(methodDetach), detachMessage(a.claimUID, containerID)
	if a.action == "attach" {
		method = methodAttach
		message = attachMessage(a.claimUID, a.shareID, containerID, pid, lines)
	}
	text, err := call(a.socket, method, message, deadline)
	if err != nil {
		var hookErr *hookError
		if !errors.As(err, &hookErr) {
			hookErr = &hookError{strerror(err)}
		}
		return fail(stderr, a.action+" "+containerID+" of claim "+a.claimUID+" failed: "+
			hookErr.msg, exitFailed)
	}
	_, _ = io.WriteString(stdout, text+"\n")
	return 0
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}
