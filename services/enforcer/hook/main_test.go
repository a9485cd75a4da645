package main

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"os"
	"strings"
	"testing"
)

// vectors are testdata/vectors.json: what the Python side (the protobuf classes, repr(),
// float(), attachwire.bounded, bytes.decode) gives for each case. A Python test
// (services/enforcer/tests/test_hook_go.py) checks that the file is what Python gives today,
// and rewrites it when run as a script.
type vectors struct {
	Attach []struct {
		ClaimUID    string   `json:"claim_uid"`
		ShareID     string   `json:"share_id"`
		ContainerID string   `json:"container_id"`
		Pid         int64    `json:"pid"`
		CgroupLines []string `json:"cgroup_lines"`
		Hex         string   `json:"hex"`
	} `json:"attach"`
	Detach []struct {
		ClaimUID    string `json:"claim_uid"`
		ContainerID string `json:"container_id"`
		Hex         string `json:"hex"`
	} `json:"detach"`
	Repr []struct {
		JSON string `json:"json"`
		Repr string `json:"repr"`
	} `json:"repr"`
	Float []struct {
		Text string  `json:"text"`
		Repr *string `json:"repr"` // nil: float() refuses it
	} `json:"float"`
	Bounded []struct {
		Text  string `json:"text"`
		Limit int    `json:"limit"`
		Out   string `json:"out"`
	} `json:"bounded"`
	Decode []struct {
		Hex  string `json:"hex"`
		Text string `json:"text"`
	} `json:"decode"`
	Lines []struct {
		Text  string   `json:"text"`
		Lines []string `json:"lines"`
	} `json:"lines"`
}

func load(t *testing.T) vectors {
	t.Helper()
	data, err := os.ReadFile("testdata/vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	var v vectors
	if err := json.Unmarshal(data, &v); err != nil {
		t.Fatal(err)
	}
	return v
}

func TestMessagesAreTheProtobufMessages(t *testing.T) {
	v := load(t)
	if len(v.Attach) == 0 || len(v.Detach) == 0 {
		t.Fatal("no message vectors")
	}
	for _, c := range v.Attach {
		got := hex.EncodeToString(attachMessage(c.ClaimUID, c.ShareID, c.ContainerID, c.Pid, c.CgroupLines))
		if got != c.Hex {
			t.Errorf("attach %+v:\n got %s\nwant %s", c, got, c.Hex)
		}
	}
	for _, c := range v.Detach {
		if got := hex.EncodeToString(detachMessage(c.ClaimUID, c.ContainerID)); got != c.Hex {
			t.Errorf("detach %+v:\n got %s\nwant %s", c, got, c.Hex)
		}
	}
}

func TestFrame(t *testing.T) {
	got := frame(methodAttach, []byte("\x0a\x05known"))
	if want := "GSH1\x01\x00\x00\x00\x07\x0a\x05known"; string(got) != want {
		t.Errorf("frame: %q, want %q", got, want)
	}
}

func TestPythonSpellings(t *testing.T) {
	v := load(t)
	for _, c := range v.Repr {
		if got := pyRepr([]byte(c.JSON)); got != c.Repr {
			t.Errorf("repr of %s: %s, want %s", c.JSON, got, c.Repr)
		}
	}
	for _, c := range v.Float {
		f, ok := pyFloat(c.Text)
		switch {
		case c.Repr == nil && ok:
			t.Errorf("float(%q) is refused by Python, accepted here as %v", c.Text, f)
		case c.Repr != nil && !ok:
			t.Errorf("float(%q) is %s in Python, refused here", c.Text, *c.Repr)
		case c.Repr != nil && pyFloatRepr(f) != *c.Repr:
			t.Errorf("float(%q): %s, want %s", c.Text, pyFloatRepr(f), *c.Repr)
		}
	}
	for _, c := range v.Bounded {
		if got := bounded(c.Text, c.Limit); got != c.Out {
			t.Errorf("bounded(%q, %d) = %q, want %q", c.Text, c.Limit, got, c.Out)
		}
	}
	for _, c := range v.Decode {
		raw, _ := hex.DecodeString(c.Hex)
		if got := decodeReplace(raw); got != c.Text {
			t.Errorf("decode %s: %q, want %q", c.Hex, got, c.Text)
		}
	}
	for _, c := range v.Lines {
		got := splitLines(c.Text)
		if strings.Join(got, "\x00") != strings.Join(c.Lines, "\x00") || len(got) != len(c.Lines) {
			t.Errorf("splitLines(%q) = %q, want %q", c.Text, got, c.Lines)
		}
	}
}

func TestRunRefusesBadInput(t *testing.T) {
	for _, c := range []struct {
		argv   []string
		stdin  string
		status int
		stderr string
	}{
		{[]string{"attach", "--claim-uid", "u"}, "", exitUsage, "--socket is required\n" + usage},
		{[]string{"attach", "--socket", "/s", "--claim-uid", "u"}, `{"id": "c", "pid": 0}`, exitUsage,
			"the OCI state has no pid to attach"},
		{[]string{"detach", "--socket", "/s", "--claim-uid", "u"}, `{"pid": 3}`, exitUsage,
			"the OCI state has no container id"},
		{[]string{"detach", "--socket", "/s", "--claim-uid", "u"}, `{"id": "c", "pid": 1.5}`, exitUsage,
			"the OCI state has a bad pid 1.5"},
	} {
		var stdout, stderr bytes.Buffer
		status := run(c.argv, strings.NewReader(c.stdin), &stdout, &stderr)
		if status != c.status || stderr.String() != prefix+c.stderr+"\n" {
			t.Errorf("%q: exit %d, stderr %q; want %d, %q", c.argv, status, stderr.String(), c.status, c.stderr)
		}
	}
	var stdout, stderr bytes.Buffer
	if status := run([]string{"--help"}, strings.NewReader(""), &stdout, &stderr); status != 0 ||
		stdout.String() != usage+"\n" {
		t.Errorf("--help: exit %d, stdout %q", status, stdout.String())
	}
}

func TestTheAttachSocketFollowsTheLink(t *testing.T) {
	dir := t.TempDir()
	plain := dir + "/enforcer.sock"
	if got := attachSocketPath(plain); got != plain+".attach" {
		t.Errorf("no link: %s", got)
	}
	if err := os.Symlink("enforcer-0b7e.sock", plain); err != nil {
		t.Fatal(err)
	}
	if got := attachSocketPath(plain); got != dir+"/enforcer-0b7e.sock.attach" {
		t.Errorf("relative link: %s", got)
	}
	if err := os.Symlink("/run/x/enforcer-1.sock", dir+"/abs.sock"); err != nil {
		t.Fatal(err)
	}
	if got := attachSocketPath(dir + "/abs.sock"); got != "/run/x/enforcer-1.sock.attach" {
		t.Errorf("absolute link: %s", got)
	}
	for path, want := range map[string]string{"a": "", "/a": "/", "/a/b": "/a", "a//b": "a", "//a": "//"} {
		if got := pyDirname(path); got != want {
			t.Errorf("dirname(%q) = %q, want %q", path, got, want)
		}
	}
}
