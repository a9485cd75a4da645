package main

// The attach socket's wire contract, as services/enforcer/src/gpuslice_enforcer/attachwire.py
// states it:
//
//	request: "GSH1" | method (1 attach, 2 detach) | u32 big-endian length | protobuf message
//	reply:   status (0 OK, else the gRPC status code) | u32 big-endian length | UTF-8 text

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"
)

const (
	magic        = "GSH1"
	methodAttach = 1
	methodDetach = 2
	statusOK     = 0
	attachSuffix = ".attach"
	maxReply     = 1 << 16 // the longest reply read; a longer one is a protocol error
	maxText      = 1024    // the longest error text the enforcer sends; the hook prints 4x
	firstDelay   = 10 * time.Millisecond
	lastDelay    = 250 * time.Millisecond
	lastTry      = 5 * time.Millisecond // one last connect at the deadline
)

// statusNames are the gRPC status codes by number.
var statusNames = [...]string{
	"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
	"ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
	"ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
	"UNAUTHENTICATED",
}

// hookError is a failed call, worded for the runtime's log.
type hookError struct{ msg string }

func (e *hookError) Error() string { return e.msg }

var errDeadline = &hookError{"DEADLINE_EXCEEDED: the enforcer did not answer in time"}

// ---- protobuf, by hand (the fields of AttachContainerRequest and DetachContainerRequest) ----

func appendVarint(b []byte, v uint64) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

func appendString(b []byte, field uint64, text string) []byte {
	b = appendVarint(b, field<<3|2)
	b = appendVarint(b, uint64(len(text)))
	return append(b, text...)
}

// attachMessage is AttachContainerRequest serialized (proto3: default values omitted).
func attachMessage(claimUID, shareID, containerID string, pid int64, lines []string) []byte {
	var b []byte
	for i, text := range [...]string{claimUID, shareID, containerID} {
		if text != "" {
			b = appendString(b, uint64(i+1), text)
		}
	}
	if pid != 0 {
		b = appendVarint(b, 4<<3)
		b = appendVarint(b, uint64(pid))
	}
	for _, line := range lines {
		b = appendString(b, 5, line)
	}
	return b
}

// detachMessage is DetachContainerRequest serialized.
func detachMessage(claimUID, containerID string) []byte {
	var b []byte
	for i, text := range [...]string{claimUID, containerID} {
		if text != "" {
			b = appendString(b, uint64(i+1), text)
		}
	}
	return b
}

func frame(method byte, message []byte) []byte {
	b := make([]byte, 0, len(magic)+5+len(message))
	b = append(b, magic...)
	b = append(b, method)
	b = binary.BigEndian.AppendUint32(b, uint32(len(message)))
	return append(b, message...)
}

// ---- the attach socket ----

// attachSocketPath is the attach socket that goes with the gRPC socket: a link (the chart's
// stable enforcer.sock) is followed once, to the serving pod's enforcer-<uid>.sock.
func attachSocketPath(socket string) string {
	target, err := os.Readlink(socket)
	if err != nil {
		return socket + attachSuffix
	}
	if !strings.HasPrefix(target, "/") {
		target = pyJoin(pyDirname(socket), target)
	}
	return target + attachSuffix
}

// pyDirname and pyJoin are Python's os.path.dirname and os.path.join (no cleaning: the same
// path text as the Python hook, in messages too).
func pyDirname(path string) string {
	head := path[:strings.LastIndex(path, "/")+1]
	if trimmed := strings.TrimRight(head, "/"); trimmed != "" {
		return trimmed
	}
	return head
}

func pyJoin(dir, name string) string {
	if dir == "" || strings.HasSuffix(dir, "/") {
		return dir + name
	}
	return dir + "/" + name
}

// call makes one call on the attach socket by deadline. Connecting is retried with a back-off
// while the enforcer is away (a restart: the socket is missing or refuses) or busy (its
// backlog is full: EAGAIN), like gRPC's wait_for_ready.
func call(socket string, method byte, message []byte, deadline time.Time) (string, error) {
	delay, retried := firstDelay, false
	for {
		path := attachSocketPath(socket)
		left := time.Until(deadline)
		if left <= 0 {
			if !retried {
				return "", errDeadline
			}
			left = time.Millisecond // the last try, after a back-off that overslept the deadline
		}
		conn, err := net.DialTimeout("unix", path, left)
		if err != nil {
			busy := errors.Is(err, syscall.EAGAIN)
			if !busy && !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ECONNREFUSED) {
				return "", ioError(path, err)
			}
			left = time.Until(deadline) - lastTry
			if left <= 0 {
				if busy {
					return "", &hookError{"UNAVAILABLE: the enforcer on " + path +
						" stayed busy (its backlog full) until the timeout"}
				}
				return "", &hookError{"UNAVAILABLE: no enforcer listened on " + path +
					" (" + strerror(err) + ") until the timeout" + olderEnforcer(socket, err)}
			}
			time.Sleep(min(delay, left))
			delay, retried = min(2*delay, lastDelay), true
			continue
		}
		text, err := exchange(conn, path, method, message, deadline)
		_ = conn.Close()
		return text, err
	}
}

// olderEnforcer explains a gRPC socket without an attach socket: an enforcer older than the
// attach socket, which the Python hook reached through gRPC and this one does not speak.
func olderEnforcer(socket string, err error) string {
	if !errors.Is(err, syscall.ENOENT) {
		return ""
	}
	if _, err := os.Stat(socket); err != nil {
		return ""
	}
	return "; " + socket + " has no attach socket beside it: an enforcer that old is reached " +
		"only through gRPC, which this hook does not speak"
}

// exchange sends the request and reads the reply, all by deadline.
func exchange(conn net.Conn, path string, method byte, message []byte, deadline time.Time) (string, error) {
	if err := conn.SetDeadline(deadline); err != nil {
		return "", ioError(path, err)
	}
	if _, err := conn.Write(frame(method, message)); err != nil {
		return "", ioError(path, err)
	}
	head := make([]byte, 5)
	if _, err := io.ReadFull(conn, head); err != nil {
		return "", ioError(path, err)
	}
	status, size := head[0], binary.BigEndian.Uint32(head[1:])
	if size > maxReply {
		return "", &hookError{"the enforcer's reply is too long (" +
			strconv.FormatUint(uint64(size), 10) + " bytes)"}
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(conn, body); err != nil {
		return "", ioError(path, err)
	}
	text := bounded(decodeReplace(body), 2*maxText)
	if status != statusOK {
		name := "STATUS_" + strconv.Itoa(int(status))
		if int(status) < len(statusNames) {
			name = statusNames[status]
		}
		return "", &hookError{name + ": " + text}
	}
	return text, nil
}

// ioError words a failed socket operation as the Python hook does.
func ioError(path string, err error) error {
	switch {
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		return &hookError{"the enforcer closed the connection before it answered"}
	case errors.Is(err, os.ErrDeadlineExceeded):
		return errDeadline
	}
	return &hookError{path + ": " + strerror(err)}
}

// strerror is the C library's text of the error number behind err, as Python's OSError
// .strerror gives it ("No such file or directory"); Go's own texts are the same in lower case.
func strerror(err error) string {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return err.Error()
	}
	text := errno.Error()
	if text == "" {
		return text
	}
	return strings.ToUpper(text[:1]) + text[1:]
}

// ---- texts ----

// bounded cuts text to limit characters (code points), saying so, as attachwire.bounded does.
func bounded(text string, limit int) string {
	count := utf8.RuneCountInString(text)
	if count <= limit {
		return text
	}
	end := 0
	for i := 0; i < limit; i++ {
		_, size := utf8.DecodeRuneInString(text[end:])
		end += size
	}
	return text[:end] + "… (" + strconv.Itoa(count-limit) + " more characters)"
}

// decodeReplace decodes UTF-8 as Python's bytes.decode(errors="replace"): each maximal
// invalid subpart becomes one U+FFFD.
func decodeReplace(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	var out strings.Builder
	for len(b) > 0 {
		r, size := utf8.DecodeRune(b)
		if r != utf8.RuneError || size > 1 {
			out.Write(b[:size])
			b = b[size:]
			continue
		}
		out.WriteRune(utf8.RuneError)
		b = b[invalidPrefix(b):]
	}
	return out.String()
}

// invalidPrefix is the length of the maximal subpart of a UTF-8 sequence at the start of b,
// which is not a whole character.
func invalidPrefix(b []byte) int {
	low, high, need := byte(0x80), byte(0xBF), 0
	switch c := b[0]; {
	case c >= 0xC2 && c <= 0xDF:
		need = 1
	case c == 0xE0:
		need, low = 2, 0xA0
	case c == 0xED:
		need, high = 2, 0x9F
	case c >= 0xE1 && c <= 0xEF:
		need = 2
	case c == 0xF0:
		need, low = 3, 0x90
	case c >= 0xF1 && c <= 0xF3:
		need = 3
	case c == 0xF4:
		need, high = 3, 0x8F
	default:
		return 1
	}
	i := 1
	for ; i <= need && i < len(b); i++ {
		if b[i] < low || b[i] > high {
			break
		}
		low, high = 0x80, 0xBF
	}
	return i
}
